"""Speculative decoding in the scheduler core, against the model-free worker (tests/doubles/
fake_worker.py) that drafts with a chosen accuracy and checks every KV read: outputs equal plain
decoding whatever the drafts, rejected drafts' KV is never kept (a wrong token in a kept slot
fails the worker's check), their pages go back, stops and max_new_tokens cut inside an accepted
run, and depth adapts (batch size, acceptance, opt-out)."""
from __future__ import annotations

import random

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.scheduler.speculation import SpeculationPolicy
from services.scheduler.step_costs import StepCosts
from tests.doubles.fake_link import drive
from tests.doubles.fake_worker import VOCAB, FakeWorker, reference_output

EOS = 0
K = 6


def make(draft_hits: int, num_pages=256, page_size=1, verify_max_rows=0, timing=None, **cfg):
    limits = ModelLimits(num_pages, page_size, 512, VOCAB, (EOS,), max_draft_tokens=K,
                         verify_max_rows=verify_max_rows)
    config = SchedulerConfig(**{"speculative_row_cost": 0.1, **cfg})  # the fake's rows cost little
    return Scheduler(config, limits), FakeWorker(num_pages, page_size, config.max_running_requests, draft_hits, timing)


def sp(max_new=24, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(3 + 2 * i)] for i in range(n)}


@pytest.mark.parametrize("overlap", [False, True], ids=["lockstep", "overlap"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("draft_hits", [0, 2, K])
def test_outputs_equal_plain_decoding_and_every_page_returns(overlap, page_size, draft_hits):
    sched, worker = make(draft_hits, page_size=page_size)
    todo = prompts(3)
    for rid, p in todo.items():
        sched.submit(rid, p, sp(ignore_eos=True), seed=0)
    res = drive(sched, worker, 2 if overlap else 1)  # the invariants are checked every round
    for rid, p in todo.items():
        assert res[rid][0] == reference_output(p, 24), rid
    s = sched.stats
    assert s.spec_verify_items > 0 and worker.verify_rows
    if draft_hits == K:  # every draft accepted whole: fewer steps than tokens
        assert s.spec_accepted_tokens == s.spec_draft_tokens > 0
    if draft_hits == 0:
        assert s.spec_accepted_tokens == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == sched.kv.num_pages
    assert sched.kv.cache.locked_pages == 0


def test_a_rejected_draft_gives_its_pages_back_at_once():
    sched, worker = make(draft_hits=0, page_size=1)
    sched.submit("a", [5, 6, 7], sp(ignore_eos=True, max_new=40), seed=0)
    held = []

    def after(core):
        for req in core.running.values():
            if not core.steps_in_flight:  # between steps: only the KV computed (+ nothing planned)
                held.append(len(req.pages) - req.computed)

    drive(sched, worker, 1, after)
    assert held and max(held) <= 0, held  # no page past the accepted tokens is kept


def test_stop_token_and_max_new_tokens_cut_inside_an_accepted_run():
    p = [3, 9, 4]
    ref = reference_output(p, 40)
    stop = ref[10]
    sched, worker = make(draft_hits=K)
    sched.submit("stop", p, sp(max_new=40, stop_token_ids=[stop]), seed=0)
    sched.submit("len", p, sp(max_new=7, ignore_eos=True), seed=0)
    res = drive(sched, worker)
    assert res["stop"][0] == ref[:ref.index(stop) + 1] and res["stop"][1] == "stop"
    assert res["len"][0] == ref[:7] and res["len"][1] == "length"
    assert sched.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["lockstep", "overlap"])
def test_abort_and_retraction_mid_speculation_free_everything(overlap):
    sched, worker = make(draft_hits=3, num_pages=40, page_size=2, init_new_token_ratio=0.1)
    todo = {f"r{i}": [1 + (i * 7 + j) % (VOCAB - 1) for j in range(10)] for i in range(8)}
    for rid, p in todo.items():
        sched.submit(rid, p, sp(max_new=30, ignore_eos=True), seed=0)
    aborted = []

    def after(core):  # once requests were retracted, abort one with a draft to verify (or in flight)
        verifying = [r for r in core.running.values() if r.verifying_speculative or r.draft]
        if core.stats.retracted and not aborted and verifying:
            aborted.append(verifying[0].rid)
            core.abort(aborted[0])

    res = drive(sched, worker, 2 if overlap else 1, after)
    assert aborted and res[aborted[0]][1] == "abort"
    for rid in set(todo) - set(aborted):
        assert res[rid][0] == reference_output(todo[rid], 30), rid
    assert sched.stats.retracted > 0 and sched.stats.spec_verify_items > 0
    assert sched.kv.allocator.num_free + sched.kv.cache.cached_pages == sched.kv.num_pages
    assert sched.kv.cache.locked_pages == 0


def test_drafts_are_trimmed_to_the_workers_one_call_rows():
    sched, worker = make(draft_hits=K, verify_max_rows=5)
    for rid, p in prompts(3).items():
        sched.submit(rid, p, sp(ignore_eos=True), seed=0)
    drive(sched, worker)
    assert worker.verify_rows and max(worker.decode_rows) <= 5


def test_opt_out_logprobs_and_a_large_batch_get_no_draft():
    sched, worker = make(draft_hits=K, speculative_disable_batch_size=2)
    sched.submit("out", [4, 5], sp(speculative=False), seed=0)
    sched.submit("lp", [4, 6], sp(logprobs=True), seed=0)
    res = drive(sched, worker)
    assert sched.stats.spec_verify_items == 0 and not worker.verify_rows
    assert res["out"][0] == reference_output([4, 5], 24, (EOS,))
    sched, worker = make(draft_hits=K, speculative_disable_batch_size=2)
    for rid, p in prompts(3).items():  # three running > 2: off until the batch shrinks
        sched.submit(rid, p, sp(ignore_eos=True, max_new=8), seed=0)
    drive(sched, worker)
    assert sched.stats.spec_verify_items == 0


def test_the_output_carries_the_requests_speculation_counters():
    sched, worker = make(draft_hits=2)
    sched.submit("a", [7, 8, 9], sp(ignore_eos=True), seed=0)
    last = []
    drive(sched, worker, 1, lambda core: last.extend(core._outputs))
    s = sched.stats
    assert s.spec_verify_items > 0 and s.spec_accepted_tokens > 0
    req = sched.running.get("a")
    assert req is None  # finished


def policy(**kw) -> SpeculationPolicy:
    return SpeculationPolicy(**{"max_depth": 8, "disable_batch_size": 16, "costs": StepCosts(0.4), **kw})


class _Req:
    def __init__(self, rid="a", **sampling):
        self.rid, self.sampling = rid, SamplingParams(**sampling)


def test_depth_follows_acceptance_and_batch_size():
    p = policy()
    req = _Req()
    for _ in range(20):
        p.verified(req, 8, 8)
    assert p.depth(req, 1) == 8  # drafts always accepted: as deep as allowed
    for _ in range(20):
        p.verified(req, 5, 4)
    assert p.depth(req, 1) == 2  # 80%: the expected gain peaks at 2 (2.44 tokens for 1.8 steps)
    assert p.depth(req, 8) == 0  # in a batch of 8 a row costs more than its expected tokens
    assert p.depth(req, 17) == 0  # above disable_batch_size
    for _ in range(20):
        p.verified(req, 4, 0)
    assert p.depth(req, 1) == 0  # drafts that are never accepted stop being asked for
    assert p.depth(_Req("b"), 1) >= 0
    assert policy(max_depth=0).depth(_Req(), 1) == 0
    assert p.depth(_Req("c", speculative=False), 1) == 0
    assert p.depth(_Req("d", logprobs=True), 1) == 0


def test_a_request_that_stopped_speculating_is_tried_again():
    p = policy()
    req = _Req()
    for _ in range(20):
        p.verified(req, 4, 0)
    p.prior = 0.9  # the fleet's drafts are doing well
    depths = [p.depth(req, 1) for _ in range(200)]
    assert depths[0] == 0 and depths[-1] > 0


def test_a_run_of_whole_acceptances_deepens_at_once_and_a_partial_one_ends_it():
    p = policy()
    req = _Req()
    for _ in range(10):
        p.verified(req, 4, 2)  # 50%: the average alone keeps drafts short
    shallow = p.depth(req, 1)
    p.verified(req, shallow, shallow)  # a quote starts being copied: accepted whole
    p.verified(req, 2, 2)
    assert p.depth(req, 1) > shallow + 1
    p.verified(req, 6, 1)  # the copy ended
    assert p.depth(req, 1) <= shallow


def test_measured_costs_decide_depth_not_the_prior():
    """The same acceptance (80%) drafts deep where extra tokens are cheap, and not at all where
    each one costs nearly a whole step or the drafter is slow."""
    cheap, steep, slow_drafter = StepCosts(0.4), StepCosts(0.4), StepCosts(0.4)
    for n in range(1, 10):
        cheap.observe_step(n, 0.010 + 0.0005 * (n - 1), 0.0, 0)
        steep.observe_step(n, 0.010 + 0.009 * (n - 1), 0.0, 0)
        slow_drafter.observe_step(n, 0.010 + 0.0005 * (n - 1), 0.0, 0)
    slow_drafter.observe_step(1, 0.010, 0.0, 0)
    slow_drafter.observe_step(2, 0.0105 + 0.024, 0.024, 3)  # 8 ms per drafted token
    depths = {}
    for name, costs in (("cheap", cheap), ("steep", steep), ("slow drafter", slow_drafter)):
        p, req = policy(costs=costs), _Req()
        for _ in range(20):
            p.verified(req, 5, 4)
        depths[name] = p.depth(req, 1)
    assert depths == {"cheap": 8, "steep": 0, "slow drafter": 0}, depths


@pytest.mark.parametrize("overlap", [False, True], ids=["lockstep", "overlap"])
def test_a_worker_whose_extra_tokens_cost_a_step_each_stops_being_asked_to_draft(overlap):
    """The worker's reported step times reach the policy: drafts whose verify costs more than
    the tokens it gains stop after the first few steps, and outputs stay plain decoding's."""
    results = {}
    for name, timing in (("cheap", (0.010, 0.001, 0.0)), ("steep", (0.010, 0.012, 0.0))):
        sched, worker = make(draft_hits=2, timing=timing)
        todo = prompts(1)
        for rid, p in todo.items():
            sched.submit(rid, p, sp(ignore_eos=True, max_new=60), seed=0)
        res = drive(sched, worker, 2 if overlap else 1)
        for rid, p in todo.items():
            assert res[rid][0] == reference_output(p, 60), rid
        results[name] = worker.decode_rows[len(worker.decode_rows) // 2:]  # the later half's tokens per step
    assert max(results["cheap"]) > 1, results["cheap"]
    assert max(results["steep"]) == 1, results["steep"]
