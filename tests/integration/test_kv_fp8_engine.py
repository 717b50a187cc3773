"""FP8 KV (--kv-cache-dtype) through the Engine on the real model: greedy output agrees with
unquantized KV over a good prefix, the pool holds ~2x bfloat16's tokens at the same byte budget,
the KV accounting returns to baseline; and the one-call decode stack's FP8 write and attention
are bit-identical to the op-by-op path's (so the C++ rounding is torch's).

The agreement runs the float32 model: its output does not depend on how requests are batched,
so a divergence is FP8's doing. (A bfloat16 model's does: an FP8 pool of twice the pages batches
and retracts differently than the bf16 one, and that alone flips near-tied tokens.)"""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPoolSpec
from services.worker.model_runner import ModelRunner
from tests.integration.reference import prompt_ids

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2)
BUDGET = 64 << 20  # float32 KV: 1456 tokens, so 8 long prompts retract; FP8: 4x that
# FP8 may flip a greedy token only where float32 KV's top-2 logprob gap is below this (measured
# here: every e4m3 flip was at a gap < 0.29 — the model is often near-tied on a chat's first token —
# and e5m2's, with half the mantissa, < 0.51): the output agrees up to the first such near-tie.
NEAR_TIE = {"fp8_e4m3": 0.6, "fp8_e5m2": 1.0}
MIN_AGREEMENT = {"fp8_e4m3": 0.3, "fp8_e5m2": 0.2}  # mean share of tokens before the first divergence
# The best prompt's share: e4m3 keeps some prompt token-exact all the way; e5m2 need not (on an
# AVX2-only EPYC its best prompt agreed 26 of 32 tokens, then flipped at a top-2 gap of 0.158).
MIN_BEST = {"fp8_e4m3": 1.0, "fp8_e5m2": 0.75}


def _engine(checkpoint, tokenizer, kv: str) -> Engine:
    worker = WorkerConfig(dtype="float32", kv_cache_dtype=kv, kv_cache_bytes=BUDGET, max_requests=8)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=8), checkpoint=checkpoint,
                  tokenizer=tokenizer)


def _agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / len(b)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_ids(tokenizer)[:8]


@pytest.fixture(scope="module")
def f32_outputs(checkpoint, tokenizer, prompts):
    eng = _engine(checkpoint, tokenizer, "auto")
    try:
        assert eng.runner.pool.k.dtype == torch.float32
        bf16 = KVPoolSpec.from_budget(eng.runner.model_config, eng.limits.page_size, torch.bfloat16, BUDGET, None)
        return bf16.num_pages, eng.generate_batch(prompts, GREEDY)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_greedy_agrees_with_unquantized_kv_and_frees_everything(checkpoint, tokenizer, prompts, f32_outputs,
                                                                       kv):
    bf16_pages, reference = f32_outputs
    eng = _engine(checkpoint, tokenizer, kv)
    try:
        assert eng.runner.pool.k.element_size() == 1
        assert eng.limits.num_pages >= 1.9 * bf16_pages  # same --kv-cache-bytes, ~2x the tokens
        sched = eng.scheduler
        baseline = sched.kv.allocator.num_free + sched.kv.cache.evictable_pages
        outputs = eng.generate_batch(prompts, GREEDY)
        assert all(o.error is None and len(o.token_ids) == NEW_TOKENS for o in outputs)
        shares = [_agreement(o.token_ids, ref.token_ids) for o, ref in zip(outputs, reference)]
        mean = sum(shares) / len(shares)
        print(f"{kv}: greedy agreement with float32 KV {mean:.3f} per prompt {[round(s, 2) for s in shares]}")
        for i, (out, ref) in enumerate(zip(outputs, reference)):
            n = round(shares[i] * NEW_TOKENS)
            if n < NEW_TOKENS:
                top = ref.logprobs[n].top
                gap = top[0].logprob - top[1].logprob
                print(f"  prompt {i}: diverges at token {n}, float32 KV's top-2 gap there {gap:.3f}")
                assert gap < NEAR_TIE[kv], f"prompt {i}: {kv} flipped token {n} at a top-2 gap of {gap:.3f}"
        assert mean >= MIN_AGREEMENT[kv]
        assert max(shares) >= MIN_BEST[kv]
        sched.check_invariants()
        assert sched.kv.allocator.num_free + sched.kv.cache.evictable_pages == baseline == eng.limits.num_pages
    finally:
        eng.shutdown()


PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]  # 13 tokens, decode crosses a page


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_stack_on_fp8_kv_is_bit_identical_to_op_by_op(checkpoint, kv, dtype):
    runners = [ModelRunner(WorkerConfig(dtype=dtype, kv_cache_dtype=kv, kv_cache_bytes=4 << 20, max_requests=2,
                                        decode_stack=stack), checkpoint) for stack in (True, False)]
    assert runners[0].decode_stack and not runners[1].decode_stack
    logits = []
    for r in runners:
        r.execute(StepPlan(0, [NewRequestSpec("a", PROMPT, [], SamplingParams(temperature=0), 0)],
                           [StepItem("a", PROMPT, 0, [0, 1], True)]))
        steps = []
        for pos in range(len(PROMPT), len(PROMPT) + 6):
            out, _ = r.compute_logits(StepPlan(pos, [], [StepItem("a", [r.requests["a"].output_ids[-1]], pos, [])]))
            r.requests["a"].output_ids.append(int(out[0].argmax()))
            steps.append(out)
        logits.append(torch.cat(steps))
    assert torch.equal(logits[0], logits[1])
    for name in ("k", "v"):
        a, b = (getattr(r.pool, name)[:, :32].view(torch.uint8) for r in runners)
        assert torch.equal(a, b)  # the stack's C++ rounding stored torch's bytes
