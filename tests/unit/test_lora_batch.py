"""Many adapters in one step: a mixed batch (base rows and four adapters, one of them on two
requests apart) equals each request run alone; the LRU over slots; the base model untouched."""
from __future__ import annotations

import pytest
import torch

from bench.common.random_adapter import make_random_adapter
from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.model.linear import Linear
from tests.unit.lora_fixtures import lora_runner, run_together, save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_batch")
    path, hf = save_tiny_llama(root / "base")
    ranks = {"a": 8, "b": 16, "c": 4, "d": 8}
    dirs = {n: make_random_adapter(hf, str(root / n), r, 2 * r + 1, seed=i + 1)
            for i, (n, r) in enumerate(ranks.items())}
    return path, dirs


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_batch_equals_each_alone(tiny):
    path, dirs = tiny
    adapters = {"r0": "", "r1": "a", "r2": "b", "r3": "", "r4": "c", "r5": "d", "r6": "a"}
    requests = {rid: (_tokens(i, 9 + 2 * i), adapter) for i, (rid, adapter) in enumerate(adapters.items())}
    chunks = {rid: [5 + i] for i, rid in enumerate(requests)}  # then decodes, all in the same steps
    together = run_together(lora_runner(path, dirs), requests, chunks)
    alone = lora_runner(path, dirs)
    for step, rid in enumerate(requests):
        ref = run_together(alone, {rid: requests[rid]}, {rid: chunks[rid]}, first_step=100 * step)[rid]
        assert [p for p, _ in together[rid]] == [p for p, _ in ref]
        for (p, ours), (_, want) in zip(together[rid], ref):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{rid} position {p}: {m}")


def test_lru_evicts_least_recently_used_not_in_step(tiny):
    path, dirs = tiny
    runner = lora_runner(path, dirs, max_loras=2)
    loras, tokens, seen, steps = runner.loras, _tokens(9, 6), {}, iter(range(0, 1000, 10))

    def step(*names: str) -> None:
        """One prefill step of a request per adapter; an adapter reloaded into any slot gives the same logits."""
        reqs = {f"{n}{len(seen)}": (tokens, n) for n in names}
        out = run_together(runner, reqs, {r: [len(tokens)] for r in reqs}, first_step=next(steps))
        for rid, (_, name) in reqs.items():
            row = out[rid][0][1]
            torch.testing.assert_close(row, seen.setdefault(name, row), atol=1e-6, rtol=0)

    step("a")
    step("b")
    assert loras.slots == ["a", "b"]
    step("c")  # a is the least recently used
    assert loras.slots == ["c", "b"]
    step("b")
    step("c", "d")  # c is the least recently used, but this step uses it: b goes
    assert loras.slots == ["c", "d"]
    step("a", "d")
    assert loras.slots == ["a", "d"]
    assert {i.name: i.resident for i in loras.infos()} == {"a": True, "b": False, "c": False, "d": True}
    assert len({float(row.sum()) for row in seen.values()}) == 4  # four different adapters
    with pytest.raises(RuntimeError, match="3 distinct LoRA adapters, more than the worker's --max-loras 2"):
        step("a", "b", "c")


def test_no_adapter_forward_is_bit_identical(tiny):
    path, dirs = tiny
    plain, served = lora_runner(path), lora_runner(path, dirs)
    assert all(m.lora is None for m in plain.model.modules() if isinstance(m, Linear))
    requests = {"p": (_tokens(1, 17), ""), "q": (_tokens(2, 11), "")}
    chunks = {"p": [9], "q": [4, 4]}
    run_together(served, {"warm": (_tokens(3, 5), "a")}, {"warm": [5]})  # an adapter resident, hooks in place
    want = run_together(plain, requests, chunks)
    got = run_together(served, requests, chunks, first_step=50)
    for rid in requests:
        for (p, ours), (_, ref) in zip(got[rid], want[rid]):
            assert torch.equal(ours, ref), f"{rid} position {p}"
    for name in dirs:
        served.loras.unload(name)
    assert all(m.lora is None for m in served.model.modules() if isinstance(m, Linear))


def test_one_call_decode_declined_for_adapter_steps(tiny):
    """The C++ decode stack has no LoRA: a decode step with an adapter request runs op by op."""
    path, dirs = tiny
    runner = lora_runner(path, dirs)
    runner.one_call_rows = 4  # as on a GGUF model whose stack was built (only the offer is checked here)
    sp = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, [NewRequestSpec("base", [1, 2], [], sp, 0),
                                NewRequestSpec("tuned", [1, 2], [], sp, 0, adapter="a")]))
    decode = {rid: StepItem(rid, [3], 2, [0], True) for rid in ("base", "tuned")}
    reqs = {rid: runner.requests[rid] for rid in decode}
    assert runner._one_call(StepPlan(1, [], [decode["base"]]), [reqs["base"]]) is not None
    assert runner._one_call(StepPlan(1, [], list(decode.values())), list(reqs.values())) is None
