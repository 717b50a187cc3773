"""The one-call decode step (kernels/cpu/decode_stack.cpp) against the op-by-op path it
replaces, on the real SmolLM2 file: bit-identical logits and KV, used exactly for small
pure-decode steps, and clear errors for bad indices."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner

PROMPTS = {"a": [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198],  # 13 tokens: 1 page of 16 + 1
           "b": [1, 4093, 198, 504, 1175, 282, 4649, 25, 28, 30, 2, 198, 1, 9690, 198, 2683, 314, 253, 5356, 30]}
PAGES = {"a": [0, 1, 2], "b": [3, 4, 5]}


def _int8_built() -> bool:
    from kernels import quant_gemv
    module = quant_gemv.load()
    return module is not None and module.int8_activations()


# (dtype, --quant-activations): float32 activations in both dtypes, int8 (builds with an int8 path) in bfloat16
ACTIVATIONS = [("bfloat16", "float32"), ("float32", "float32"),
               pytest.param("bfloat16", "int8", marks=pytest.mark.skipif(
                   not _int8_built(), reason="no int8 path in this build (it needs AVX2)"))]


@pytest.fixture(scope="module")
def runners(checkpoint):
    """(dtype, stack, team spin, activations) -> a ModelRunner, reused while it is one of the two
    asked for last (a test compares two at most); an older one is closed, so that the module holds
    two models' memory, not one per combination (it peaked at 8.5 GB). Tests reset() them."""
    built: dict[tuple[str, bool, int, str], ModelRunner] = {}

    def get(dtype: str, stack: bool, spin_us: int = 100, activations: str = "float32") -> ModelRunner:
        key = (dtype, stack, spin_us, activations)
        if key in built:
            built[key] = built.pop(key)  # the most recently asked for last
        else:
            while len(built) >= 2:
                built.pop(next(iter(built))).close()
            built[key] = ModelRunner(WorkerConfig(
                dtype=dtype, kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2, decode_stack=stack,
                step_team_spin_us=spin_us, quant_activations=activations), checkpoint)
        runner = built[key]
        runner.reset()
        return runner
    yield get
    for runner in built.values():
        runner.close()


def _decode(runner: ModelRunner, rids: list[str], steps: int) -> list[torch.Tensor]:
    """Prefill the prompts (op by op: not a decode step), then greedy-decode `steps` steps
    of the given requests together; returns each step's logits."""
    specs = [NewRequestSpec(r, PROMPTS[r], [], SamplingParams(temperature=0), 0) for r in rids]
    runner.execute(StepPlan(0, specs, [StepItem(r, PROMPTS[r], 0, PAGES[r], True) for r in rids]))
    pos = {r: len(PROMPTS[r]) for r in rids}
    out = []
    for step in range(1, steps + 1):
        plan = StepPlan(step, [], [StepItem(r, [runner.requests[r].output_ids[-1]], pos[r], []) for r in rids])
        logits, _ = runner.compute_logits(plan)
        out.append(logits)
        for r, row in zip(rids, logits):
            runner.requests[r].output_ids.append(int(row.argmax()))
            pos[r] += 1
    return out


@pytest.mark.parametrize("dtype,activations", ACTIVATIONS)
def test_stack_logits_and_kv_are_bit_identical_to_op_by_op(runners, dtype, activations):
    """Batch 1 and 2 with different lengths, across a page boundary (positions 13..20 and 20..27);
    with int8 activations too (the stack and the op-by-op linears quantize x alike)."""
    stacked, plain = runners(dtype, True, activations=activations), runners(dtype, False, activations=activations)
    assert stacked.decode_stack and stacked.model.decode_stack.num_layers == 30
    assert stacked.model.decode_stack.int8_activations == (activations == "int8")
    assert not plain.decode_stack and plain.model.decode_stack is None
    for rids in (["a"], ["a", "b"]):
        for r in (stacked, plain):
            r.reset()
        got, want = _decode(stacked, rids, 8), _decode(plain, rids, 8)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and torch.equal(g, w)
        assert torch.equal(stacked.pool.k, plain.pool.k) and torch.equal(stacked.pool.v, plain.pool.v)
        assert stacked.requests[rids[-1]].output_ids == plain.requests[rids[-1]].output_ids


def test_openmp_loops_give_the_same_logits(runners):
    """--step-team-spin-us -1 runs the step's loops on OpenMP: the same chunks, the same bits."""
    team, omp = runners("bfloat16", True), runners("bfloat16", True, -1)
    got, want = _decode(team, ["a", "b"], 4), _decode(omp, ["a", "b"], 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert omp.model.decode_stack.team_helpers == 0


def test_a_stalled_helper_never_holds_up_the_step_or_changes_it(runners):
    """Helpers that sleep 2 ms in every chunk (as if preempted there): the lead computes their
    chunks itself, and their late results, computed from inputs that changed under them, are
    never used: logits and KV stay bit-identical to the op-by-op path, before and after."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the team has no helpers")
    stacked, plain = runners("bfloat16", True), runners("bfloat16", False)
    for r in (stacked, plain):  # earlier tests' KV is still in the pools
        r.pool.k.zero_()
        r.pool.v.zero_()
    stack = stacked.model.decode_stack
    _decode(stacked, ["a"], 1)
    assert stack.team_helpers == torch.get_num_threads() - 1
    before = stack.team_recomputed
    stack.slow_helpers(2000)
    try:
        stacked.reset()
        slow = _decode(stacked, ["a", "b"], 3)
    finally:
        stack.slow_helpers(0)
    assert stack.team_recomputed > before  # the lead did take over
    stacked.reset()
    fast = _decode(stacked, ["a", "b"], 3)  # prompt fast helpers, their stale chunks still landing
    plain.reset()
    want = _decode(plain, ["a", "b"], 3)
    assert all(torch.equal(s, w) and torch.equal(f, w) for s, f, w in zip(slow, fast, want))
    assert torch.equal(stacked.pool.k, plain.pool.k) and torch.equal(stacked.pool.v, plain.pool.v)


def test_stack_runs_only_small_pure_decode_steps(runners, monkeypatch):
    runner = runners("bfloat16", True)
    calls, real = [0], runner.model.decode_stack

    class Counting:
        def forward(self, *args):
            calls[0] += 1
            return real.forward(*args)

    monkeypatch.setattr(runner.model, "decode_stack", Counting())
    _decode(runner, ["a"], 2)  # a prefill (op by op), then two decode steps of one row
    assert calls[0] == 2
    runner.reset()
    specs = [NewRequestSpec(r, PROMPTS[r], [], SamplingParams(temperature=0), 0) for r in ("a", "b")]
    # A mixed step (one decode row, one prefill) runs op by op.
    runner.execute(StepPlan(10, specs[:1], [StepItem("a", PROMPTS["a"], 0, PAGES["a"], True)]))
    runner.execute(StepPlan(11, specs[1:], [StepItem("a", [28], 13, []),
                                            StepItem("b", PROMPTS["b"], 0, PAGES["b"], True)]))
    assert calls[0] == 2
    # Three decode rows exceed --quant-max-rows 2: the dense path, op by op.
    runner.execute(StepPlan(12, [NewRequestSpec("c", [1, 2], [], SamplingParams(temperature=0), 0)],
                            [StepItem("c", [1, 2], 0, [6], True)]))
    runner.execute(StepPlan(13, [], [StepItem("a", [28], 14, []), StepItem("b", [28], 20, []),
                                     StepItem("c", [28], 2, [])]))
    assert calls[0] == 2
    runner.execute(StepPlan(14, [], [StepItem("a", [28], 15, []), StepItem("b", [28], 21, [])]))
    assert calls[0] == 3


def test_off_without_quantized_blocks_or_with_the_torch_backend(checkpoint):
    assert not ModelRunner(WorkerConfig(kv_cache_bytes=8 << 20, max_requests=2, quant_max_rows=0), checkpoint).decode_stack
    assert not ModelRunner(WorkerConfig(kv_cache_bytes=8 << 20, max_requests=2, attention_backend="torch"),
                           checkpoint).decode_stack


def test_bad_indices_raise_clear_errors(runners):
    runner = runners("bfloat16", True)
    model, pool, table = runner.model, runner.pool, runner.page_table
    one, zero = torch.tensor([1]), torch.tensor([0])

    def call(ids=one, pos=one, rows=zero, table=table, pool=pool):
        return model.decode_step(ids, pos, table, rows, 16, pool, zero)

    assert call().shape == (1, 49152)
    with pytest.raises(RuntimeError, match="token id out of range"):
        call(ids=torch.tensor([10 ** 6]))
    with pytest.raises(RuntimeError, match="position out of range"):
        call(pos=torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="page-table row out of range"):
        call(rows=torch.tensor([table.shape[0]]))
    bad = table.clone()
    bad[0, 0] = pool.k.shape[1]  # a page number past the pool
    with pytest.raises(RuntimeError, match="page out of range"):
        call(table=bad)
    with pytest.raises(RuntimeError, match="model's dtype"):
        call(pool=type("Pool", (), {"k": pool.k.float(), "v": pool.v.float()})())


def test_linears_only_runs_the_step_matmuls_and_checks_rows(runners):
    """bench/ceilings.py's one-call linear-only step: any row count the stack serves, nothing else."""
    stack = runners("bfloat16", True).model.decode_stack
    stack.linears_only(1)
    stack.linears_only(2)
    for bad in (0, 65):
        with pytest.raises(RuntimeError, match="1 to 64 rows"):
            stack.linears_only(bad)


def test_the_step_times_its_own_phases(runners):
    """phase_seconds(): every forward() counted, each phase's time summed (bench/single_stream_split.py
    prints them per step); reset_phases() starts over."""
    stack = runners("float32", True).model.decode_stack
    stack.reset_phases()
    _decode(runners("float32", True), ["a", "b"], 3)
    phases = stack.phase_seconds()
    assert phases.pop("steps") == 3
    assert set(phases) == {"setup", "linears", "attention", "rope_kv_write", "elementwise", "all_reduce", "lm_head"}
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["linears"] > phases["attention"] > 0 and phases["lm_head"] > 0
    assert phases["all_reduce"] == 0  # no group
    stack.reset_phases()
    assert stack.phase_seconds() == dict.fromkeys(phases, 0.0) | {"steps": 0}


@pytest.mark.parametrize("dtype,activations", ACTIVATIONS)
def test_a_verify_item_gives_the_logits_of_decoding_its_tokens_one_by_one(runners, dtype, activations):
    """Speculation's verify item [last, d1..d5] runs as one call: six rows sharing the request's
    page-table row at consecutive positions (each attends over the KV the rows before it wrote in
    the same layer). Its logits and KV equal six one-token steps', bit for bit, beside another
    request's decode: with int8 activations too, each row being quantized alone."""
    runner = runners(dtype, True, activations=activations)
    steps = _decode(runner, ["a", "b"], 6)  # one by one: a's tokens and logits at each step
    decoded = list(runner.requests["a"].output_ids)
    k_one, v_one = runner.pool.k.clone(), runner.pool.v.clone()
    runner.reset()
    specs = [NewRequestSpec(r, PROMPTS[r], [], SamplingParams(temperature=0), 0) for r in ("a", "b")]
    runner.execute(StepPlan(0, specs, [StepItem(r, PROMPTS[r], 0, PAGES[r], True) for r in ("a", "b")]))
    first = runner.requests["a"].output_ids[-1]
    assert first == decoded[0]
    b_pos = len(PROMPTS["b"])
    plan = StepPlan(1, [], [StepItem("a", [first] + decoded[1:6], len(PROMPTS["a"]), [], verify=True),
                            StepItem("b", [runner.requests["b"].output_ids[-1]], b_pos, [])])
    assert runner._one_call(plan, [runner.requests["a"], runner.requests["b"]]) is not None  # the stack takes it
    logits, _ = runner.compute_logits(plan)  # [6 rows of a, 1 row of b]
    assert torch.equal(logits[:6], torch.stack([s[0] for s in steps]))
    assert torch.equal(logits[6], steps[0][1])
    positions = range(len(PROMPTS["a"]), len(PROMPTS["a"]) + 6)  # a's pages 0-2: slots are positions
    assert torch.equal(runner.pool.k[:, list(positions)], k_one[:, list(positions)])
    assert torch.equal(runner.pool.v[:, list(positions)], v_one[:, list(positions)])


def _kquant_blocks(w: torch.Tensor, qtype: str) -> np.ndarray:
    """A minimal k-quant quantizer for the tests (gguf cannot quantize k-quants): w float32
    [N, K], K a multiple of 256 → the GGUF rows of Q4_K, Q5_K or Q6_K, round to nearest."""
    N = w.shape[0]
    sb = w.float().numpy().reshape(-1, 256)
    n = sb.shape[0]

    def over(a, b):  # a / b, 0 where b is 0
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0)

    if qtype == "Q6_K":
        g = sb.reshape(n, 16, 16)
        d = (np.abs(g).max(-1).max(-1, keepdims=True) / 31 / 127).astype(np.float16)
        sc = np.round(over(np.abs(g).max(-1) / 31, d.astype(np.float32))).clip(-128, 127).astype(np.int8)
        eff = (d.astype(np.float32) * sc.astype(np.float32))[..., None]
        v = (np.round(over(g, eff)).clip(-32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)
        ql, qh = np.zeros((n, 2, 64), np.uint8), np.zeros((n, 2, 32), np.uint8)
        for gi in range(8):  # 32-value group gi: half gi // 4, slot s = gi % 4
            h, s = divmod(gi, 4)
            ql[:, h, (s % 2) * 32:(s % 2) * 32 + 32] |= (v[:, gi] & 15) << (4 * (s // 2))
            qh[:, h] |= (v[:, gi] >> 4) << (2 * s)
        return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)],
                              axis=1).reshape(N, -1)
    top = 15 if qtype == "Q4_K" else 31
    g = sb.reshape(n, 8, 32)
    lo = np.minimum(g.min(-1), 0)
    scale, mn = (g.max(-1) - lo) / top, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mn.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.round(over(scale, d.astype(np.float32))).clip(0, 63).astype(np.uint8)
    m = np.round(over(mn, dmin.astype(np.float32))).clip(0, 63).astype(np.uint8)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = np.round(over(g + (dmin.astype(np.float32) * m)[..., None], eff)).clip(0, top).astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(n, 128)  # chunk c: groups 2c (low), 2c + 1 (high)
    parts = [d.view(np.uint8), dmin.view(np.uint8), scales]
    if qtype == "Q5_K":
        parts.append(np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate([*parts, qs], axis=1).reshape(N, -1)


def _requantize(runner: ModelRunner, dense: ModelRunner) -> None:
    """Every layer's linears on formats other than the file's, from `dense`'s float32 weights:
    qkv Q5_0, o Q5_1, gate_up Q4_0, down (K = 1536) Q4_K, Q5_K or Q6_K by layer; the LM head stays Q8_0."""
    import gguf

    from kernels.quant_gemv import QuantWeight

    def simple(w: torch.Tensor, qtype: str) -> QuantWeight:
        blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[qtype])
        return QuantWeight.from_blocks(torch.from_numpy(blocks), qtype)

    kquants = ("Q4_K", "Q5_K", "Q6_K")
    for i, (layer, src) in enumerate(zip(runner.model.layers, dense.model.layers)):
        for lin, w in ((layer.self_attn.qkv_proj, simple(src.self_attn.qkv_proj.weight.detach(), "Q5_0")),
                       (layer.self_attn.o_proj, simple(src.self_attn.o_proj.weight.detach(), "Q5_1")),
                       (layer.mlp.gate_up_proj, simple(src.mlp.gate_up_proj.weight.detach(), "Q4_0")),
                       (layer.mlp.down_proj, QuantWeight.from_blocks(torch.from_numpy(_kquant_blocks(
                           src.mlp.down_proj.weight.detach(), kquants[i % 3])), kquants[i % 3]))):
            lin.set_quant(w, lin.quant_max_rows, lin._quant_kernel)


def test_kquant_test_quantizer_is_close_to_its_source():
    import gguf
    w = torch.randn(6, 512) * 0.05
    for qtype, tol in (("Q4_K", 0.25), ("Q5_K", 0.12), ("Q6_K", 0.06)):
        blocks = _kquant_blocks(w, qtype)
        back = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
        assert float((back - w).norm() / w.norm()) < tol, qtype


def test_stack_on_every_format_is_bit_identical_to_op_by_op(checkpoint):
    """Q5_0 / Q5_1 / Q4_0 / Q4_K / Q5_K / Q6_K linears (quantized from the file's weights), batch 1
    and 2: the stack's logits and KV equal the op-by-op path's on the same blocks, bit for bit.
    (float32: the matmuls' math is float32 in every dtype; bf16 rounding is the Q4_1 tests' part.)"""
    from kernels import decode_stack
    config = dict(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2)
    stacked = ModelRunner(WorkerConfig(**config, decode_stack=True), checkpoint)
    plain = ModelRunner(WorkerConfig(**config, decode_stack=False), checkpoint)
    for r in (stacked, plain):
        _requantize(r, plain)
    assert stacked.model.use_decode_stack(decode_stack.load())
    for rids in (["a"], ["a", "b"]):
        for r in (stacked, plain):
            r.reset()
        got, want = _decode(stacked, rids, 5), _decode(plain, rids, 5)
        for step, (g, w) in enumerate(zip(got, want)):
            assert bool(torch.isfinite(w).all()), step
            assert torch.equal(g, w), (rids, step, float((g - w).abs().max()))
        assert torch.equal(stacked.pool.k, plain.pool.k) and torch.equal(stacked.pool.v, plain.pool.v)
        assert stacked.requests[rids[-1]].output_ids == plain.requests[rids[-1]].output_ids


@pytest.mark.parametrize("quantization,qtype", [("int8", "int8"), ("gguf", "Q4_1")])
def test_quantized_only_weights_run_on_the_stack_bit_identical_to_op_by_op(checkpoint, quantization, qtype):
    """--quantization int8 (the layers' per-channel int8 linears, the file's Q8_0 head) and gguf
    (the file's blocks only; the embedding too, looked up in Python and handed to the stack) run
    on the one-call stack, and its logits and KV equal the op-by-op path's on the same weights."""
    from services.worker.model.quant_embedding import QuantEmbedding
    config = dict(dtype="float32", kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2,
                  quantization=quantization)
    stacked = ModelRunner(WorkerConfig(**config, decode_stack=True), checkpoint)
    plain = ModelRunner(WorkerConfig(**config, decode_stack=False), checkpoint)
    assert stacked.model.decode_stack is not None and plain.model.decode_stack is None
    assert stacked.model.decode_stack_rows == 2  # --quant-max-rows, though quantized-only linears take any
    assert stacked.model.layers[0].self_attn.qkv_proj.quant.qtype == qtype
    assert isinstance(stacked.model.embed_tokens, QuantEmbedding) == (quantization == "gguf")
    for rids in (["a"], ["a", "b"]):
        for r in (stacked, plain):
            r.reset()
        got, want = _decode(stacked, rids, 4), _decode(plain, rids, 4)
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (rids, step, float((g - w).abs().max()))
        assert torch.equal(stacked.pool.k, plain.pool.k) and torch.equal(stacked.pool.v, plain.pool.v)
