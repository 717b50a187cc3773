"""The scheduler core against a model-free worker that checks every KV read."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import ModelLimits, Scheduler, common_prefix_len
from services.scheduler.worker_link import WorkerLost
from services.step.contract import LAST_SAMPLED
from tests.doubles.fake_link import FakeLink, drive
from tests.doubles.fake_worker import VOCAB, FakeWorker, reference_output

EOS = 0


def make(num_pages=64, page_size=1, context=256, **cfg):
    limits = ModelLimits(num_pages, page_size, context, VOCAB, (EOS,))
    config = SchedulerConfig(**cfg)
    return Scheduler(config, limits), FakeWorker(num_pages, page_size, config.max_running_requests)


def run(sched: Scheduler, worker: FakeWorker, max_steps=5000, on_step=None, overlap=False) -> dict:
    """Drive until idle with the StepDriver; returns rid -> (output tokens, finish reason, cached tokens).
    overlap: plan the next step before processing the last one's result, as the
    scheduler service and the Engine do (the worker runs plans in order, one queued behind another)."""
    return drive(sched, worker, 2 if overlap else 1, on_step, max_steps)


def sp(max_new=8, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_outputs_match_the_reference_and_release_everything(overlap):
    sched, worker = make()
    prompts = {f"r{i}": [random.Random(i).randrange(1, VOCAB) for _ in range(5 + i)] for i in range(6)}
    for rid, p in prompts.items():
        sched.submit(rid, p, sp(ignore_eos=True), seed=0)
    res = run(sched, worker, overlap=overlap)
    for rid, p in prompts.items():
        assert res[rid][0] == reference_output(p, 8), rid
        assert res[rid][1] == "length"
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == 64
    assert sched.kv.cache.locked_pages == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_cache_hit_and_shared_prefix_waits_for_the_first(overlap):
    sched, worker = make(num_pages=512, chunked_prefill_size=32)
    system = [1 + i % (VOCAB - 1) for i in range(100)]  # a 100-token shared prefix
    for i in range(4):  # arrive together: only the first computes the prefix
        sched.submit(f"q{i}", system + [i + 1, i + 2], sp(ignore_eos=True), seed=0)
    res = run(sched, worker, overlap=overlap)
    cached = sorted(res[f"q{i}"][2] for i in range(4))
    # All but the last partial chunk of the prefix is shared (recomputing 4 tokens beats waiting).
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:]), cached


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_under_tiny_kv_never_deadlocks_and_outputs_stay_exact(overlap):
    sched, worker = make(num_pages=40, page_size=2)
    prompts = {f"r{i}": [1 + (i * 7 + j) % (VOCAB - 1) for j in range(10)] for i in range(8)}
    for rid, p in prompts.items():
        sched.submit(rid, p, sp(max_new=20, ignore_eos=True), seed=0)
    res = run(sched, worker, overlap=overlap)
    assert sched.stats.retracted > 0
    for rid, p in prompts.items():
        assert res[rid][0] == reference_output(p, 20), rid


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_kv_waiting_and_running(overlap):
    sched, worker = make()
    sched.submit("a", [1, 2, 3], sp(max_new=50, ignore_eos=True), seed=0)
    sched.submit("b", [4, 5, 6], sp(max_new=50, ignore_eos=True), seed=0)
    sched.process(worker.execute(sched.schedule()))
    sched.abort("a")
    sched.submit("c", [7, 8], sp(), seed=0)
    sched.abort("c")  # still waiting
    res = run(sched, worker, overlap=overlap)
    assert res["a"][1] == "abort" and res["c"][1] == "abort" and res["b"][1] == "length"
    assert sched.stats.aborted == 2
    assert sched.kv.cache.locked_pages == 0 and not sched.running


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_min_new_tokens_and_stop_ids(overlap):
    sched, worker = make()
    prompt = [3, 4, 5]
    ref = reference_output(prompt, 40)
    stop = ref[5]
    sched.submit("s", prompt, sp(max_new=40, stop_token_ids=[stop], ignore_eos=True), seed=0)
    res = run(sched, worker, overlap=overlap)
    assert res["s"][0] == ref[: ref.index(stop) + 1] and res["s"][1] == "stop"


@pytest.mark.parametrize("prompt,params,message", [
    ([], sp(), "empty"),
    ([1, VOCAB], sp(), "outside the vocabulary"),
    ([1, -1], sp(), "outside the vocabulary"),
    ([1] * 250, sp(max_new=10), "context length"),
    ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
    ([1, 2], SamplingParams(top_p=-0.5), "top_p"),
    ([1, 2], SamplingParams(max_new_tokens=-1), "max_new_tokens"),
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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, page_size=st.sampled_from([1, 2, 4]), chunk=st.sampled_from([-1, 3, 8]),
       num_pages=st.integers(20, 60), policy=st.sampled_from(["fcfs", "lpm"]),
       cache_off=st.booleans(), seed=st.integers(0, 1000), overlap=st.booleans())
def test_random_workloads_keep_invariants_and_exact_outputs(reqs, page_size, chunk, num_pages, policy,
                                                             cache_off, seed, overlap):
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

    res = run(sched, worker, on_step=maybe_abort, overlap=overlap)
    for rid, (prompt, max_new) in prompts.items():
        out, reason, _ = res[rid]
        ref = reference_output(prompt, max_new, stop_ids=(EOS,))
        if reason == "abort":
            assert out == ref[: len(out)]
        else:
            assert out == ref, rid
    assert not sched.running and sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == num_pages


# --- overlapped scheduling: the next plan is built while the worker runs the last one ---------

def test_overlap_plans_decodes_ahead_with_last_sampled_and_wastes_no_step_on_length():
    sched, worker = make()
    prompt = [3, 4, 5, 6]
    sched.submit("a", prompt, sp(max_new=8, ignore_eos=True), seed=0)
    first = sched.schedule()  # the prompt
    second = sched.schedule()  # planned before the first token is known
    assert sched.steps_in_flight == 2
    assert second.items[0].input_ids == [LAST_SAMPLED] and second.items[0].start_pos == len(prompt)
    outs = sched.process(worker.execute(first))
    assert [o.token_ids for o in outs] == [reference_output(prompt, 1)]
    sched.process(worker.execute(second))
    res = run(sched, worker, overlap=True)
    assert res["a"] == [reference_output(prompt, 8)[2:], "length", 0]
    # 1 prefill + 7 decodes: the step that samples the 8th token is the last one planned.
    # Every decode was planned before its input was known but the third (planned by run()
    # after both results above were processed).
    assert worker.forward_steps == 8 and worker.filled == 6


def test_overlap_a_stop_token_wastes_one_step_and_frees_everything():
    sched, worker = make(num_pages=32, page_size=2)
    prompt = [3, 4, 5]
    ref = reference_output(prompt, 40)
    stop = ref[5]
    sched.submit("s", prompt, sp(max_new=40, stop_token_ids=[stop], ignore_eos=True), seed=0)
    res = run(sched, worker, overlap=True)
    n = ref.index(stop) + 1
    assert res["s"][:2] == [ref[:n], "stop"]
    assert worker.forward_steps == n + 1  # the step planned before the stop token came back ran for nothing
    assert not worker.tables  # the worker was told to drop the request
    assert sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == 32


def test_overlap_abort_and_retraction_while_a_step_is_in_flight():
    sched, worker = make(num_pages=24, page_size=2)
    prompts = {f"r{i}": [1 + (i * 5 + j) % (VOCAB - 1) for j in range(8)] for i in range(5)}
    for rid, p in prompts.items():
        sched.submit(rid, p, sp(max_new=12, ignore_eos=True), seed=0)
    in_flight = sched.schedule()
    sched.abort("r0")  # applied by the next schedule(), while `in_flight` runs
    ahead = sched.schedule()
    assert sched.steps_in_flight == 2 and "r0" not in [it.rid for it in ahead.items]
    early: dict[str, list[int]] = {}
    for plan in (in_flight, ahead):
        for o in sched.process(worker.execute(plan)):
            assert o.rid != "r0" or (o.finished and o.finish_reason == "abort")
            early.setdefault(o.rid, []).extend(o.token_ids)
    res = run(sched, worker, overlap=True)
    assert sched.stats.retracted > 0  # 24 pages cannot hold 5 x 20 tokens
    for rid, p in prompts.items():
        if rid != "r0":
            assert early.get(rid, []) + res[rid][0] == reference_output(p, 12), rid
    assert sched.kv.cache.locked_pages == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == 24


def test_step_failed_undoes_the_plan_so_nothing_unwritten_is_cached():
    sched, worker = make(num_pages=64, page_size=2, chunked_prefill_size=4)
    prompt = list(range(1, 11))
    sched.submit("a", prompt, sp(max_new=4, ignore_eos=True), seed=0)
    sched.process(worker.execute(sched.schedule()))  # the first 4-token chunk: cached
    failed = sched.schedule()
    assert sched.step_failed() is failed and sched.steps_in_flight == 0
    sched.abort("a")
    run(sched, worker)
    hit = sched.kv.cache.match_prefix(prompt, "")
    assert hit.num_tokens == 4  # the failed chunk's tokens were never cached


@pytest.mark.parametrize("overlap", [False, True])
def test_driver_failure_policy_ends_open_requests_and_goes_on_with_a_fresh_core(overlap):
    sched, worker = make()
    for rid in ("a", "b"):
        sched.submit(rid, [1, 2, 3], sp(max_new=20, ignore_eos=True), seed=0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    failures, fresh = [], {}

    def deliver(outs):
        for o in outs:
            tokens.setdefault(o.rid, []).extend(o.token_ids)
            if o.finished:
                finished[o.rid] = o.finish_reason

    async def recover(exc, reason):
        assert isinstance(exc, WorkerLost)
        failures.append((reason, sorted(driver.core.running)))  # the host ends these
        core, new_worker = make()  # the worker forgot everything too
        core.submit("c", [4, 5, 6], sp(max_new=5, ignore_eos=True), seed=0)
        fresh["core"] = core
        return core, FakeLink(new_worker)

    link = FakeLink(worker, fail_step=3)
    driver = StepDriver(DriverHooks(recover, deliver=deliver), sched, link, depth=2 if overlap else 1,
                        busy_wait_s=0)
    asyncio.run(driver.run())
    assert failures == [("worker error: step 3 lost", ["a", "b"])]
    assert link.closed and driver.core is fresh["core"] and not driver.core.has_work
    assert finished == {"c": "length"} and tokens["c"] == reference_output([4, 5, 6], 5)
    assert tokens["a"] == reference_output([1, 2, 3], 2)  # steps 1 and 2 were answered
