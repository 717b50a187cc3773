"""The "triton" attention backend (services/worker/attention/triton_backend.py) against the torch
reference backend, on CPU under Triton's interpreter: (a) hand-built steps mixing decode and
extend items over a paged pool, every layer variant, FP8 pools; (b) issue 19's check, a short
greedy run of the default model through the ModelRunner, token for token equal to
--attention-backend torch."""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.attention.backend import Attached, DecodeStep, create_backend
from services.worker.attention.batch_layout import BatchLayout, slots_of
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.attention.triton_backend import TritonAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.model.layer_attention import LayerAttention
from services.worker.model_runner import ModelRunner

import triton  # a declared dependency: never skipped

H, HKV, D, LAYERS = 6, 2, 64, 2
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def _step(g, q_lens: list[int], starts: list[int], page_size: int, pool_dtype: torch.dtype, num_pages: int = 64):
    """A layout over distinct random pages, and two pools (one per backend) holding the same
    random prefix K/V (written through KVPool.write, so FP8 pools hold rotated bytes)."""
    need = [-(-(s + n) // page_size) for s, n in zip(starts, q_lens)]
    perm = torch.randperm(num_pages, generator=g)
    rows = torch.zeros(len(q_lens), max(need), dtype=torch.int64)
    used = 0
    for i, n in enumerate(need):
        rows[i, :n] = perm[used:used + n]
        used += n
    layout = BatchLayout.build(q_lens, starts, rows, page_size)
    spec = KVPoolSpec(num_pages, page_size, LAYERS, HKV, D, pool_dtype)
    pools = KVPool(spec), KVPool(spec)
    item = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(starts))  # [prefix tokens]
    pos = torch.cat([torch.arange(s) for s in starts])
    prefix_slots = slots_of(rows, item, pos, page_size)
    for layer in range(LAYERS):
        k, v = (torch.randn(len(prefix_slots), HKV, D, generator=g) for _ in range(2))
        for pool in pools:
            pool.write(layer, prefix_slots, k, v)
    return layout, pools


def _compare(layout, pools, dtype, variants, g, scale=D ** -0.5, window=None):
    """Runs every layer through both backends with the same q, k, v; returns the largest difference."""
    ours, ref = TritonAttentionBackend(scale, window), TorchAttentionBackend(scale, sliding_window=window)
    ours.prepare(layout, pools[0])
    ref.prepare(layout, pools[1])
    T = len(layout.positions)
    for layer in range(LAYERS):
        for variant in variants:
            q = (torch.randn(T, H + 2, D, generator=g) * 2).to(dtype)[:, 1:H + 1]  # strided, as the model's
            k, v = (torch.randn(T, HKV, D, generator=g).to(dtype) for _ in range(2))
            got, want = ours.forward(layer, q, k, v, variant), ref.forward(layer, q, k, v, variant)
            assert got.shape == q.shape and got.dtype == dtype
            torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(pools[0].k.view(torch.uint8), pools[1].k.view(torch.uint8))  # the same K/V written
    assert torch.equal(pools[0].v.view(torch.uint8), pools[1].v.view(torch.uint8))


VARIANTS = [None, LayerAttention(0.1, window=24), LayerAttention(0.2, softcap=2.0), LayerAttention(0.1, 9, 1.5)]


@pytest.mark.slow  # 1.1-1.5 s each under Triton's interpreter: `make test` runs them, `make test-fast` does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_mixed_step_equals_the_torch_backend(dtype, page_size):
    """Decode items (one after a long prefix, one on an empty one) between extend items (a
    prefill with no prefix, a chunk after a cached prefix), every variant, two layers."""
    g = torch.Generator().manual_seed(page_size)
    layout, pools = _step(g, [1, 70, 1, 9], [100, 0, 0, 33], page_size, dtype, num_pages=400 // page_size + 8)
    _compare(layout, pools, dtype, VARIANTS, g)


@pytest.mark.parametrize("q_lens, starts", [([1, 1, 1], [0, 40, 77]), ([5, 17], [0, 50])], ids=["decode", "extend"])
def test_single_kind_steps_and_the_backends_window(q_lens, starts):
    g = torch.Generator().manual_seed(len(q_lens))
    layout, pools = _step(g, q_lens, starts, 16, torch.float32)
    _compare(layout, pools, torch.float32, [None, VARIANTS[2]], g, window=20)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pools_equal_the_torch_backend(pool_dtype, dtype):
    """Rows widened in the kernels; q rotated before, the output after, as the torch backend does."""
    g = torch.Generator().manual_seed(7)
    layout, pools = _step(g, [1, 12, 1], [60, 20, 0], 16, pool_dtype)
    _compare(layout, pools, dtype, [None, VARIANTS[3]], g)


def test_the_backend_contract():
    backend = create_backend("triton", scale=0.125, sliding_window=32)
    assert isinstance(backend, TritonAttentionBackend) and backend.default == LayerAttention(0.125, 32)
    assert backend.attach(None, None, None, False) == Attached()
    pool = KVPool(KVPoolSpec(4, 4, 1, HKV, D, torch.float32))
    step = DecodeStep([1], [0], [0], [0], torch.zeros(1, 4, dtype=torch.int64), 4, pool)
    assert backend.one_call_step(step, lambda: pytest.fail("computed")) is None
    # prepare builds the per-step tensors once: the group tensors sit on the pool's device
    layout = BatchLayout.build([1, 3], [5, 0], torch.tensor([[0, 1], [2, 3]]), 4)
    backend.prepare(layout, pool)
    assert backend.decode.rows.tolist() == [0] and backend.decode.kv_lens.tolist() == [6]
    assert backend.extend.rows.tolist() == [1, 2, 3] and backend.extend.cu_q.tolist() == [0, 3]
    assert backend.decode.num_splits == 1 and backend.extend.max_q_len == 3


PROMPTS = {"a": [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198],
           "b": [1, 4093, 198, 504, 1175, 282, 4649, 25, 28, 30, 2, 198, 1, 9690, 198, 2683, 314, 253, 5356, 30]}


def _greedy(runner: ModelRunner, new_tokens: int) -> dict[str, list[int]]:
    """a's prefill; then a decodes while b's prompt is prefilled in the same step (a mixed step),
    then both decode: greedy tokens, new_tokens of b's and one more of a's."""
    greedy = SamplingParams(temperature=0)
    spec = {r: NewRequestSpec(r, PROMPTS[r], [], greedy, 0) for r in PROMPTS}
    out = {"a": runner.execute(StepPlan(0, [spec["a"]], [StepItem("a", PROMPTS["a"], 0, [0, 1, 2], True)]))
           .next_token_ids[:1]}
    plan = StepPlan(1, [spec["b"]], [StepItem("a", out["a"][-1:], len(PROMPTS["a"]), []),
                                     StepItem("b", PROMPTS["b"], 0, [3, 4, 5], True)])
    first = runner.execute(plan).next_token_ids
    out["a"].append(first[0])
    out["b"] = [first[1]]
    for step in range(2, new_tokens + 1):
        items = [StepItem(r, out[r][-1:], len(PROMPTS[r]) + len(out[r]) - 1, []) for r in ("a", "b")]
        for r, token in zip(("a", "b"), runner.execute(StepPlan(step, [], items)).next_token_ids):
            out[r].append(token)
    return out


def test_the_default_model_decodes_as_the_torch_backend_does(checkpoint):
    """Issue 19: float32 on CPU, the Triton kernels interpreted, 8-9 greedy tokens per request
    equal to the torch backend's."""
    runs = {}
    for backend in ("triton", "torch"):
        runner = ModelRunner(WorkerConfig(dtype="float32", device="cpu", kv_cache_bytes=8 << 20, max_requests=4,
                                          attention_backend=backend), checkpoint)
        runs[backend] = _greedy(runner, 8)
    assert isinstance(runner.backend, TorchAttentionBackend)
    assert {r: len(tokens) for r, tokens in runs["triton"].items()} == {"a": 9, "b": 8}
    assert runs["triton"] == runs["torch"]
