"""EAGLE-3 on the real default model changes no output (issue 39), with the head shipped for it
(`--speculative-algorithm EAGLE3` alone: no path): greedy and sampled-at-a-seed outputs equal plain
decoding's, token for token, for chain drafts (verified as one-call decode steps) and tree drafts
(verified op by op under a tree mask), on copy-heavy prompts and on ordinary chat prompts the head
never trained on; the trained head's drafts are accepted at a measured rate; and retraction plus
an abort mid-speculation leave no KV behind.

dtypes: float32 (the reference), and the default dtype one request at a time (the one-call
stack's rows are computed independently, so its logits do not depend on the batch)."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.test_speculative_engine import run_aborting_one
from tests.unit.test_eagle_drafter import record_trees

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
COPY_HEAVY = [c["messages"] for c in json.loads((ROOT / "bench" / "data" / "copy_heavy.json").read_text())]
CHAT = [p["messages"] for p in json.loads(
    (ROOT / "services" / "worker" / "speculative" / "data" / "draft_prompts.json").read_text())["prompts"]
    if p["split"] == "heldout"]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_new_tokens=MAX_TOKENS, ignore_eos=True)


def engine(checkpoint, tokenizer, dtype: str, **spec) -> Engine:
    worker = WorkerConfig(dtype=dtype, kv_cache_bytes=96 << 20, **spec)
    # "fixed": these check what verifies give, so drafts must run whatever this CPU's steps cost
    return Engine(worker=worker, scheduler=SchedulerConfig(speculative_cost_model="fixed"), checkpoint=checkpoint,
                  tokenizer=tokenizer)


def close(e: Engine) -> None:
    e.shutdown()
    gc.collect()


def one_at_a_time(e: Engine, ids: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    return [e.generate_batch([p], sampling)[0].token_ids for p in ids]


def check_released(e: Engine) -> None:
    e.scheduler.check_invariants()
    assert set(e.runner.drafter.streams) == set(e.runner.requests)


@pytest.fixture(scope="module")
def plain32(checkpoint, tokenizer):
    e = engine(checkpoint, tokenizer, "float32")
    try:
        ids = [e.prompt_ids(messages=m) for m in COPY_HEAVY[:5] + CHAT[:5]]
        yield ids, {"greedy": one_at_a_time(e, ids, GREEDY), "sampled": one_at_a_time(e, ids[:3] + ids[5:7], SAMPLED)}
    finally:
        close(e)


def test_the_shipped_head_float32_equals_plain_greedy_and_sampled_and_is_accepted(checkpoint, tokenizer, plain32):
    ids, want = plain32
    e = engine(checkpoint, tokenizer, "float32", speculative_algorithm="EAGLE3")
    try:
        chat = one_at_a_time(e, ids[5:], GREEDY)  # the chat prompts first: the kind the head trained on
        s = e.scheduler.stats
        accept_length = 1 + s.spec_accepted_tokens / s.spec_verify_items
        assert s.spec_verify_items > 0 and accept_length > 1.15, accept_length  # a trained head (a random one: ~1.0)
        assert one_at_a_time(e, ids[:5], GREEDY) + chat == want["greedy"]
        assert one_at_a_time(e, ids[:3] + ids[5:7], SAMPLED) == want["sampled"]
        check_released(e)
    finally:
        close(e)


def test_tree_drafts_float32_equal_plain_greedy_and_sampled(checkpoint, tokenizer, plain32):
    ids, want = plain32
    e = engine(checkpoint, tokenizer, "float32", speculative_algorithm="EAGLE3", speculative_eagle_topk=2,
               speculative_num_draft_tokens=7)
    trees = record_trees(e.runner.drafter)
    try:
        assert one_at_a_time(e, ids[:3] + ids[5:8], GREEDY) == want["greedy"][:3] + want["greedy"][5:8]
        assert one_at_a_time(e, ids[:3] + ids[5:7], SAMPLED) == want["sampled"]
        assert trees and e.scheduler.stats.spec_accepted_tokens > 0
        check_released(e)
    finally:
        close(e)


def test_default_dtype_equals_plain_one_at_a_time(checkpoint, tokenizer):
    plain = engine(checkpoint, tokenizer, "auto")
    try:
        ids = [plain.prompt_ids(messages=m) for m in COPY_HEAVY[:2] + CHAT[:3]]
        want = one_at_a_time(plain, ids, GREEDY)
    finally:
        close(plain)
    e = engine(checkpoint, tokenizer, "auto", speculative_algorithm="EAGLE3")
    try:
        assert one_at_a_time(e, ids, GREEDY) == want
        assert e.scheduler.stats.spec_accepted_tokens > 0
    finally:
        close(e)


def test_retraction_and_an_abort_mid_speculation_leave_no_kv_behind(checkpoint, tokenizer, plain32):
    """A pool too small for the batch (requests retracted and recomputed, trees in flight) and
    one request aborted while it speculates: the others' outputs are plain decoding's, and once
    the cache is flushed every page is free and the head holds no request."""
    ids, want = plain32
    bytes_per_token = 2 * 30 * 3 * 64 * 4  # float32 K and V, 30 layers, 3 KV heads of 64
    longest = max(len(p) for p in ids[:4] + [ids[8]]) + MAX_TOKENS
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=(3 * longest // 2) * bytes_per_token, page_size=4,
                          speculative_algorithm="EAGLE3", speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    e = Engine(worker=worker, scheduler=SchedulerConfig(speculative_cost_model="fixed", speculative_disable_batch_size=16,
                                                        init_new_token_ratio=0.05, min_new_token_ratio=0.05),
               checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        assert run_aborting_one(e, ids[:4], ids[8], GREEDY) == want["greedy"][:4]
        s = e.scheduler.stats
        assert s.retracted > 0 and s.spec_verify_items > 0 and s.aborted == 1
        e.scheduler.check_invariants()
        assert not e.scheduler.running and e.scheduler.flush_cache()
        assert e.scheduler.kv.allocator.num_free == e.scheduler.kv.num_pages
        e.generate_batch([ids[0]], SamplingParams(temperature=0.0, max_new_tokens=1))  # a step carries the releases
        assert set(e.runner.drafter.streams) <= set(e.runner.requests)
    finally:
        close(e)
