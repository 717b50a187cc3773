"""The scheduler core against a model-free worker that checks every KV read."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import ModelLimits, Scheduler, common_prefix_len
from tests.unit.fake_worker import VOCAB, FakeWorker, reference_output

EOS = 0


def make(num_pages=64, page_size=1, context=256, **cfg):
    limits = ModelLimits(num_pages, page_size, context, VOCAB, (EOS,))
    config = SchedulerConfig(**cfg)
    return Scheduler(config, limits), FakeWorker(num_pages, page_size, config.max_running_requests)


def run(sched: Scheduler, worker: FakeWorker, max_steps=5000, on_step=None) -> dict:
    """Step until idle; returns rid -> (output tokens, finish reason, cached tokens)."""
    results: dict = {}
    for _ in range(max_steps):
        plan = sched.schedule()
        outs = sched.take_outputs()
        if plan is not None:
            outs += sched.process(worker.execute(plan))
        for o in outs:
            entry = results.setdefault(o.rid, [[], None, 0])
            entry[0].extend(o.new_token_ids)
            assert entry[1] is None, f"{o.rid} ended twice"
            if o.finished:
                entry[1], entry[2] = o.finish_reason, o.cached_tokens
        sched.check_invariants()
        if on_step:
            on_step(sched)
        if not sched.has_work:
            return results
    raise AssertionError("scheduler did not go idle: livelock or deadlock")


def sp(max_new=8, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def test_batch_outputs_match_the_reference_and_release_everything():
    sched, worker = make()
    prompts = {f"r{i}": [random.Random(i).randrange(1, VOCAB) for _ in range(5 + i)] for i in range(6)}
    for rid, p in prompts.items():
        sched.submit(rid, p, sp(ignore_eos=True), seed=0)
    res = run(sched, worker)
    for rid, p in prompts.items():
        assert res[rid][0] == reference_output(p, 8), rid
        assert res[rid][1] == "length"
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == 64
    assert sched.kv.cache.locked_pages == 0


def test_prefix_cache_hit_and_shared_prefix_waits_for_the_first():
    sched, worker = make(num_pages=512, chunked_prefill_size=32)
    system = [1 + i % (VOCAB - 1) for i in range(100)]  # a 100-token shared prefix
    for i in range(4):  # arrive together: only the first computes the prefix
        sched.submit(f"q{i}", system + [i + 1, i + 2], sp(ignore_eos=True), seed=0)
    res = run(sched, worker)
    cached = sorted(res[f"q{i}"][2] for i in range(4))
    # All but the last partial chunk of the prefix is shared (recomputing 4 tokens beats waiting).
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:]), cached


def test_retraction_under_tiny_kv_never_deadlocks_and_outputs_stay_exact():
    sched, worker = make(num_pages=40, page_size=2)
    prompts = {f"r{i}": [1 + (i * 7 + j) % (VOCAB - 1) for j in range(10)] for i in range(8)}
    for rid, p in prompts.items():
        sched.submit(rid, p, sp(max_new=20, ignore_eos=True), seed=0)
    res = run(sched, worker)
    assert sched.stats.retracted > 0
    for rid, p in prompts.items():
        assert res[rid][0] == reference_output(p, 20), rid


def test_abort_frees_kv_waiting_and_running():
    sched, worker = make()
    sched.submit("a", [1, 2, 3], sp(max_new=50, ignore_eos=True), seed=0)
    sched.submit("b", [4, 5, 6], sp(max_new=50, ignore_eos=True), seed=0)
    sched.process(worker.execute(sched.schedule()))
    sched.abort("a")
    sched.submit("c", [7, 8], sp(), seed=0)
    sched.abort("c")  # still waiting
    res = run(sched, worker)
    assert res["a"][1] == "abort" and res["c"][1] == "abort" and res["b"][1] == "length"
    assert sched.stats.aborted == 2
    assert sched.kv.cache.locked_pages == 0 and not sched.running


def test_eos_min_new_tokens_and_stop_ids():
    sched, worker = make()
    prompt = [3, 4, 5]
    ref = reference_output(prompt, 40)
    stop = ref[5]
    sched.submit("s", prompt, sp(max_new=40, stop_token_ids=[stop], ignore_eos=True), seed=0)
    res = run(sched, worker)
    assert res["s"][0] == ref[: ref.index(stop) + 1] and res["s"][1] == "stop"


@pytest.mark.parametrize("prompt,params,message", [
    ([], sp(), "empty"),
    ([1, VOCAB], sp(), "outside the vocabulary"),
    ([1, -1], sp(), "outside the vocabulary"),
    ([1] * 250, sp(max_new=10), "context length"),
    ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
    ([1, 2], SamplingParams(top_p=-0.5), "top_p"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_input_is_rejected_with_a_message(prompt, params, message):
    sched, worker = make()
    with pytest.raises(InvalidRequest, match=message):
        sched.submit("x", prompt, params, seed=0)
    sched.submit("ok", [1, 2], sp(), seed=0)  # still serving
    assert run(sched, worker)["ok"][1] in ("stop", "length")


def test_request_that_can_never_fit_is_rejected():
    sched, _ = make(num_pages=16, page_size=1, context=256)
    with pytest.raises(InvalidRequest, match="never fit"):
        sched.submit("big", [1] * 10, sp(max_new=10), seed=0)


def test_queue_limit():
    sched, _ = make(max_queued_requests=2)
    sched.submit("a", [1], sp(), seed=0)
    sched.submit("b", [1], sp(), seed=0)
    with pytest.raises(QueueFull):
        sched.submit("c", [1], sp(), seed=0)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5] * 100 + [1], [5] * 100 + [2]) == 100


requests_st = st.lists(st.tuples(
    st.integers(0, 3),  # which shared prefix
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12),  # own suffix
    st.integers(1, 12),  # max_new_tokens
    st.booleans(),  # aborted at some point
), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, page_size=st.sampled_from([1, 2, 4]), chunk=st.sampled_from([-1, 3, 8]),
       num_pages=st.integers(20, 60), policy=st.sampled_from(["fcfs", "lpm"]),
       cache_off=st.booleans(), seed=st.integers(0, 1000))
def test_random_workloads_keep_invariants_and_exact_outputs(reqs, page_size, chunk, num_pages, policy,
                                                             cache_off, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    sched, worker = make(num_pages=num_pages, page_size=page_size, chunked_prefill_size=chunk,
                         schedule_policy=policy, disable_radix_cache=cache_off, max_running_requests=6)
    prompts, aborts = {}, []
    for i, (pfx, own, max_new, aborted) in enumerate(reqs):
        prompt = prefixes[pfx] + own
        try:
            sched.submit(f"r{i}", prompt, sp(max_new=max_new), seed=0)
        except InvalidRequest:
            assert (len(prompt) + max_new + page_size - 1) // page_size > num_pages
            continue
        prompts[f"r{i}"] = (prompt, max_new)
        if aborted:
            aborts.append(f"r{i}")

    def maybe_abort(s):
        if aborts and rng.random() < 0.3:
            s.abort(aborts.pop())

    res = run(sched, worker, on_step=maybe_abort)
    for rid, (prompt, max_new) in prompts.items():
        out, reason, _ = res[rid]
        ref = reference_output(prompt, max_new, stop_ids=(EOS,))
        if reason == "abort":
            assert out == ref[: len(out)]
        else:
            assert out == ref, rid
    assert not sched.running and sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == num_pages
