"""The Engine's API on the real model: bad input, seeds, streaming, abort, stop strings, logprobs."""
from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
import torch

from services.common.sampling_params import InvalidRequest, SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

HELLO = [{"role": "user", "content": "Write a short story about a robot."}]


@pytest.fixture(scope="module")
def engine(checkpoint, tokenizer):
    # float32: seeded samples must not depend on batch mates, which bfloat16 does not promise.
    eng = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=128 << 20, max_requests=16),
                 scheduler=SchedulerConfig(max_running_requests=16), checkpoint=checkpoint, tokenizer=tokenizer)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=""), "empty"),
    (dict(input_ids=[1, 2, 10**6]), "outside the vocabulary"),
    (dict(input_ids=[-3]), "outside the vocabulary"),
    (dict(prompt="hi", sampling=SamplingParams(temperature=-1.0)), "temperature"),
    (dict(prompt="hi", sampling=SamplingParams(top_p=float("nan"))), "top_p"),
    (dict(prompt="hi", sampling=SamplingParams(top_k=-5)), "top_k"),
    (dict(prompt="hi", sampling=SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
    (dict(input_ids=[1] * 8200, sampling=SamplingParams(max_new_tokens=16)), "context length"),
    (dict(prompt="hi", messages=HELLO), "exactly one"),
])
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(**kwargs)
    out = engine.generate(messages=[{"role": "user", "content": "Say hi."}],
                          sampling=SamplingParams(temperature=0, max_new_tokens=4))
    assert out.error is None and out.completion_tokens >= 1


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    ids = engine.prompt_ids(messages=HELLO)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=24, ignore_eos=True)
    alone = engine.generate(input_ids=ids, sampling=seeded).token_ids
    mates = [engine.prompt_ids(messages=[{"role": "user", "content": f"Count to {i}."}]) for i in range(4)]
    other = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    batch = engine.generate_batch(mates[:2] + [ids] + mates[2:], [other, other, seeded, other, other])
    assert batch[2].token_ids == alone
    different = engine.generate(input_ids=ids, sampling=SamplingParams(
        temperature=0.9, top_p=0.95, seed=99, max_new_tokens=24, ignore_eos=True)).token_ids
    assert different != alone


def test_top_k_1_equals_greedy(engine):
    ids = engine.prompt_ids(messages=HELLO)
    greedy = engine.generate(input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=16))
    topk1 = engine.generate(input_ids=ids, sampling=SamplingParams(temperature=1.3, top_k=1, max_new_tokens=16))
    assert greedy.token_ids == topk1.token_ids


def test_stop_strings_and_logprobs(engine):
    ids = engine.prompt_ids(messages=[{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate(input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=16))
    assert "Paris" in full.text
    cut = engine.generate(input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=16, stop=["Paris"]))
    assert cut.finish_reason == "stop" and cut.matched_stop == "Paris"
    assert cut.text == full.text[: full.text.index("Paris")]
    lp = engine.generate(input_ids=ids, sampling=SamplingParams(
        temperature=0, max_new_tokens=4, logprobs=True, top_logprobs=3))
    assert len(lp.logprobs) == 4
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.token_id == tok and entry.top[0].token_id == tok  # greedy picks the most likely token
        assert math.isclose(entry.top[0].logprob, entry.logprob, abs_tol=1e-5)


async def test_cancelled_stream_aborts_and_frees_kv(engine):
    sched = engine.scheduler
    baseline = sched.kv.allocator.num_free + sched.kv.cache.evictable_pages

    async def consume_some():
        n = 0
        stream = engine.stream(messages=HELLO, sampling=SamplingParams(
            temperature=0, max_new_tokens=500, ignore_eos=True))
        async with contextlib.aclosing(stream):  # closing the stream early must abort the request
            async for chunk in stream:
                n += len(chunk.token_ids)
                if n >= 5:
                    break
        return n

    aborted_before = sched.stats.aborted
    assert await consume_some() >= 5
    for _ in range(200):
        if sched.stats.aborted > aborted_before and not sched.running:
            break
        await asyncio.sleep(0.05)
    assert sched.stats.aborted == aborted_before + 1
    assert sched.kv.allocator.num_free + sched.kv.cache.evictable_pages == baseline


def test_bfloat16_engine_answers_correctly(checkpoint, tokenizer):
    """The faster bfloat16 path (AMX on this CPU) is not token-exact with the float32
    reference, but must still be the same model."""
    eng = Engine(worker=WorkerConfig(dtype="bfloat16", kv_cache_bytes=64 << 20, max_requests=4),
                 scheduler=SchedulerConfig(max_running_requests=4), checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        out = eng.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                           sampling=SamplingParams(temperature=0, max_new_tokens=12))
        assert "Paris" in out.text, out.text
        assert eng.runner.pool.k.dtype == torch.bfloat16
    finally:
        eng.shutdown()


def test_stop_strings_wait_for_min_new_tokens(engine, tokenizer):
    """A stop string found within the first min_new_tokens tokens does not end the request
    (vLLM's min_tokens semantics)."""
    ids = engine.prompt_ids(messages=[{"role": "user", "content": "Write a short story about a robot."}])
    k = 3
    plain = SamplingParams(temperature=0, max_new_tokens=16, min_new_tokens=k)
    full = engine.generate(input_ids=ids, sampling=plain)
    early = tokenizer.decode(full.token_ids[:k])
    assert full.text.startswith(early)
    stop = tokenizer.decode(full.token_ids[:1]).strip()  # text of the first token: inside the first k
    assert stop and full.text.find(stop) < len(early)

    cut = engine.generate(input_ids=ids, sampling=SamplingParams(
        temperature=0, max_new_tokens=16, min_new_tokens=k, stop=[stop]))
    later = full.text.find(stop, max(len(early) - len(stop) + 1, 0))  # first one completing past token k
    if later < 0:
        assert cut.finish_reason == full.finish_reason and cut.text == full.text
    else:
        assert cut.finish_reason == "stop" and cut.matched_stop == stop and cut.text == full.text[:later]
    assert len(cut.text) > full.text.find(stop)  # went past the early occurrence


def test_a_failed_step_fails_open_requests_and_rebuilds_the_scheduler(engine, monkeypatch):
    """The driver's failure policy, as the scheduler service applies it on worker loss: every
    open request ends with the error, and a fresh scheduler serves what comes next."""
    ids = engine.prompt_ids(messages=HELLO)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    expected = engine.generate(input_ids=ids, sampling=greedy).token_ids
    old, finished_before = engine.scheduler, engine.scheduler.stats.finished
    real, calls = engine.runner.execute, []

    def fail_the_third_step(plan):
        calls.append(plan.step_id)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real(plan)

    monkeypatch.setattr(engine.runner, "execute", fail_the_third_step)
    failed = engine.generate_batch([ids, ids[:-1]], greedy)
    monkeypatch.undo()
    for out in failed:
        assert out.finish_reason == "error" and "injected step failure" in out.error, out
        assert len(out.token_ids) < 12
    assert engine.scheduler is not old and not engine.runner.requests
    assert engine.scheduler.stats.finished == finished_before  # counters carry over
    assert engine.generate(input_ids=ids, sampling=greedy).token_ids == expected
