"""Greedy output of the Engine equals transformers', however it is batched,
chunked, cached, paged or retracted, and whether it plans one step ahead
(overlapped scheduling, the default) or runs in lockstep."""
from __future__ import annotations

import queue
import threading

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.reference import assert_matches, cached_references, prompt_ids

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = prompt_ids(tokenizer)
    assert len(ids) >= 16 and max(map(len, ids)) > 300
    return ids


@pytest.fixture(scope="module")
def references(request, model_path, prompts):
    return cached_references(model_path, prompts, NEW_TOKENS, lambda: request.getfixturevalue("hf_model"))


def make_engine(checkpoint, tokenizer, *, page_size=1, kv_bytes=256 << 20, overlap=True, **sched) -> Engine:
    worker = WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=kv_bytes, max_requests=32)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=32,
                                                           disable_overlap_schedule=not overlap, **sched),
                  checkpoint=checkpoint, tokenizer=tokenizer)


def check_all(outputs, references, label):
    for i, (out, ref) in enumerate(zip(outputs, references)):
        assert out.error is None, f"{label} prompt {i}: {out.error}"
        assert out.finish_reason == "length"
        assert_matches(out.token_ids, ref, f"{label} prompt {i}")


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "lockstep"])
def engine(request, checkpoint, tokenizer):
    eng = make_engine(checkpoint, tokenizer, overlap=request.param)
    assert eng.overlap is request.param
    yield eng
    eng.shutdown()


def test_one_at_a_time(engine, prompts, references):
    outputs = [engine.generate(input_ids=ids, sampling=GREEDY) for ids in prompts]
    check_all(outputs, references, "sequential")


def test_all_at_once_then_from_prefix_cache(engine, prompts, references):
    engine.scheduler.kv.cache.reset() if not engine.scheduler.running else None
    first = engine.generate_batch(prompts, GREEDY)
    check_all(first, references, "batched")
    second = engine.generate_batch(prompts, GREEDY)
    check_all(second, references, "cached")
    assert all(o.cached_tokens > 0 for o in second), [o.cached_tokens for o in second]
    engine.scheduler.check_invariants()


def test_staggered_arrivals(engine, prompts, references):
    """Each request arrives while the previous ones are decoding."""
    engine.scheduler.kv.cache.reset()
    sinks = [queue.SimpleQueue() for _ in prompts]
    started = [threading.Event() for _ in prompts]

    def sink_for(i):
        def sink(chunk):
            sinks[i].put(chunk)
            if chunk.completion_tokens >= 3:
                started[i].set()
        return sink

    for i, ids in enumerate(prompts):
        engine.submit(ids, GREEDY, sink_for(i))
        assert started[i].wait(timeout=120)
    outputs = [_collect(q) for q in sinks]
    check_all(outputs, references, "staggered")


def test_chunked_prefill_32(checkpoint, tokenizer, prompts, references):
    eng = make_engine(checkpoint, tokenizer, chunked_prefill_size=32)
    try:
        check_all(eng.generate_batch(prompts, GREEDY), references, "chunk32")
    finally:
        eng.shutdown()


def test_page_size_16(checkpoint, tokenizer, prompts, references):
    eng = make_engine(checkpoint, tokenizer, page_size=16)
    try:
        check_all(eng.generate_batch(prompts, GREEDY), references, "page16")
        again = eng.generate_batch(prompts, GREEDY)
        check_all(again, references, "page16 cached")
        assert all(o.cached_tokens % 16 == 0 for o in again)
        assert sum(o.cached_tokens for o in again) > 0
        eng.scheduler.check_invariants()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
def test_tiny_kv_forces_retraction(checkpoint, tokenizer, prompts, references, overlap):
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    longest = max(map(len, prompts)) + NEW_TOKENS
    eng = make_engine(checkpoint, tokenizer, kv_bytes=(longest + 64) * bytes_per_token, overlap=overlap)
    try:
        check_all(eng.generate_batch(prompts, GREEDY), references, "retraction")
        assert eng.scheduler.stats.retracted > 0
        eng.scheduler.check_invariants()
    finally:
        eng.shutdown()


def _collect(q):
    from services.common.outputs import RequestOutput
    chunks = [q.get(timeout=300)]
    while not chunks[-1].finished:
        chunks.append(q.get(timeout=300))
    return RequestOutput.joined(chunks)
