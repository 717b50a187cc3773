"""Speculative decoding changes no output (issue 18): on the real model, with the n-gram drafter,
the bundled copy-heavy workload (bench/data/copy_heavy.json) gives token for token what plain
decoding gives, greedy and sampled at a seed (the verify item draws the very sample plain decoding
draws: services/worker/speculative/drafter.py), one request at a time and batched with staggered
arrivals; and drafts were verified and accepted along the way.

dtypes: float32 everywhere. The default dtype (bfloat16 here) only one request at a time: the
one-call decode stack runs every step of one request, verify or not, on the file's quantized
blocks with rows computed independently, so its logits do not depend on the batch; a batched
plain step of more than --quant-max-rows tokens runs op by op in bfloat16 instead, whose logits
do depend on the batch (as they do without speculation)."""
from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

pytestmark = pytest.mark.slow

WORKLOAD = json.loads((Path(__file__).parents[2] / "bench" / "data" / "copy_heavy.json").read_text())
MAX_TOKENS = 48


def engine(checkpoint, tokenizer, dtype: str, spec: bool, overlap: bool = True) -> Engine:
    worker = WorkerConfig(dtype=dtype, kv_cache_bytes=96 << 20, speculative_algorithm="NGRAM" if spec else None)
    # "fixed": these check what verifies give, so drafts must run whatever this CPU's steps cost
    return Engine(worker=worker,
                  scheduler=SchedulerConfig(disable_overlap_schedule=not overlap, speculative_cost_model="fixed"),
                  checkpoint=checkpoint, tokenizer=tokenizer)


def close(e: Engine) -> None:
    e.shutdown()
    gc.collect()


def prompts(e: Engine, n: int) -> list[list[int]]:
    return [e.prompt_ids(messages=c["messages"]) for c in WORKLOAD[:n]]


def one_at_a_time(e: Engine, ids: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    return [e.generate_batch([p], sampling)[0].token_ids for p in ids]


def staggered(e: Engine, ids: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    """Each request submitted once the previous one has its first token."""
    outs: list[list[int]] = [[] for _ in ids]
    done = [threading.Event() for _ in ids]
    started = [threading.Event() for _ in ids]

    def sink_for(i):
        def sink(out):
            outs[i].extend(out.token_ids)
            started[i].set()
            if out.finished:
                done[i].set()
        return sink

    for i, p in enumerate(ids):
        e.submit(p, sampling, sink_for(i))
        assert started[i].wait(timeout=300)
    assert all(d.wait(timeout=500) for d in done)
    return outs


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_new_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def plain32(checkpoint, tokenizer):
    e = engine(checkpoint, tokenizer, "float32", spec=False)
    ids = prompts(e, len(WORKLOAD))
    yield ids, {"greedy": one_at_a_time(e, ids, GREEDY), "sampled": one_at_a_time(e, ids[:6], SAMPLED)}
    close(e)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
def test_ngram_float32_equals_plain_one_at_a_time_greedy_and_sampled(checkpoint, tokenizer, plain32, overlap):
    ids, want = plain32
    e = engine(checkpoint, tokenizer, "float32", spec=True, overlap=overlap)
    try:
        assert one_at_a_time(e, ids, GREEDY) == want["greedy"]
        assert one_at_a_time(e, ids[:6], SAMPLED) == want["sampled"]
        s = e.scheduler.stats
        assert s.spec_verify_items > 0 and s.spec_accepted_tokens > 0
        assert s.steps < len(ids) * MAX_TOKENS + 6 * MAX_TOKENS  # accepted drafts saved steps
        e.scheduler.check_invariants()
    finally:
        close(e)


def test_ngram_float32_equals_plain_batched_and_staggered(checkpoint, tokenizer, plain32):
    ids, want = plain32
    e = engine(checkpoint, tokenizer, "float32", spec=True)
    try:
        batched = [o.token_ids for o in e.generate_batch(ids[:6], GREEDY)]
        assert batched == want["greedy"][:6]
        assert staggered(e, ids[6:], GREEDY) == want["greedy"][6:]
        assert e.scheduler.stats.spec_verify_items > 0
        e.scheduler.check_invariants()
    finally:
        close(e)


def test_a_stop_string_inside_an_accepted_run_ends_the_text_where_plain_decoding_does(checkpoint, tokenizer,
                                                                                      plain32):
    """The quote and code-edit outputs copy their prompts, so their stop strings fall inside
    accepted runs: the text ends just before each, as plain decoding's does."""
    ids, want = plain32
    e = engine(checkpoint, tokenizer, "float32", spec=True)
    try:
        cases = []
        for i in (0, 5, 6):
            text = tokenizer.decode(want["greedy"][i])
            stop = text[len(text) // 2:len(text) // 2 + 6]  # a piece from the middle of the copy
            cases.append((i, stop, text[:text.index(stop)]))
        params = [SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
                  for _, stop, _ in cases]
        outs = e.generate_batch([ids[i] for i, _, _ in cases], params)
        for (i, stop, expected), out in zip(cases, outs):
            assert out.text == expected and out.finish_reason == "stop" and out.matched_stop == stop, i
        assert e.scheduler.stats.spec_accepted_tokens > 0
    finally:
        close(e)


def test_draft_model_float32_equals_plain_one_at_a_time(checkpoint, tokenizer, plain32):
    """STANDALONE: the default GGUF drafting for itself, in a second runner with its own KV."""
    from services.common.model_path import default_model_path
    ids, want = plain32
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=96 << 20, speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=default_model_path(), speculative_num_draft_tokens=4,
                          speculative_draft_kv_cache_bytes=64 << 20)
    e = Engine(worker=worker, scheduler=SchedulerConfig(speculative_cost_model="fixed"), checkpoint=checkpoint,
               tokenizer=tokenizer)
    try:
        assert one_at_a_time(e, ids[:5], GREEDY) == want["greedy"][:5]
        s = e.scheduler.stats
        assert s.spec_verify_items > 0 and s.spec_accepted_tokens > s.spec_draft_tokens // 2
        e.runner.drafter.check_invariants()
    finally:
        close(e)


def test_ngram_default_dtype_equals_plain_one_at_a_time(checkpoint, tokenizer):
    plain = engine(checkpoint, tokenizer, "auto", spec=False)
    try:
        ids = prompts(plain, 6)
        want = one_at_a_time(plain, ids, GREEDY)
    finally:
        close(plain)
    e = engine(checkpoint, tokenizer, "auto", spec=True)
    try:
        assert one_at_a_time(e, ids, GREEDY) == want
        assert e.scheduler.stats.spec_accepted_tokens > 0
    finally:
        close(e)


def run_aborting_one(e: Engine, ids: list[list[int]], victim: list[int], sampling: SamplingParams) -> list[list[int]]:
    """Submit `ids` and then `victim`, aborting the victim once it has a token (speculating by
    then) → the others' outputs, after every request ended."""
    outs: list[list[int]] = [[] for _ in ids]
    done = [threading.Event() for _ in range(len(ids) + 1)]
    aborted: list[str] = []

    def sink_for(i):
        def sink(out):
            if i == len(ids) and out.token_ids and not aborted:
                aborted.append(out.rid)
                e.abort(out.rid)
            if i < len(ids):
                outs[i].extend(out.token_ids)
            if out.finished:
                done[i].set()
        return sink

    for i, p in enumerate(ids):
        e.submit(p, sampling, sink_for(i))
    e.submit(victim, sampling, sink_for(len(ids)))
    assert all(d.wait(timeout=500) for d in done)
    return outs


def test_retraction_and_an_abort_mid_speculation_leave_no_kv_behind(checkpoint, tokenizer, plain32):
    """A KV pool too small for the batch (requests are retracted and recomputed, drafts in
    flight) and one request aborted while it speculates: the others' outputs are plain decoding's,
    the accounting holds after every run, and once the cache is flushed every page is free."""
    ids, want = plain32
    bytes_per_token = 2 * 30 * 3 * 64 * 4  # float32 K and V, 30 layers, 3 KV heads of 64
    longest = max(len(p) for p in ids[:4] + [ids[8]]) + MAX_TOKENS  # the pool holds one request and a bit
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=(3 * longest // 2) * bytes_per_token, page_size=4,
                          speculative_algorithm="NGRAM")
    e = Engine(worker=worker, scheduler=SchedulerConfig(speculative_cost_model="fixed", speculative_disable_batch_size=16,
                                                        init_new_token_ratio=0.05, min_new_token_ratio=0.05),
               checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        victim = ids[8]
        assert run_aborting_one(e, ids[:4], victim, GREEDY) == want["greedy"][:4]
        s = e.scheduler.stats
        assert s.retracted > 0 and s.spec_verify_items > 0 and s.aborted == 1
        e.scheduler.check_invariants()
        assert not e.scheduler.running and e.scheduler.flush_cache()
        assert e.scheduler.kv.allocator.num_free == e.scheduler.kv.num_pages
    finally:
        close(e)
