"""The scheduler core's store probe never blocks (issue 33): a request waits, unadmitted, for
its Exists answer while the others are scheduled; the answer, when it comes, decides its
prefetch; an answer that never comes is a miss once its bound passed.

The store here is an ExistsProbe whose futures the test answers (or never does), beside the
token-id fake worker and dict store of test_hicache_scheduler.
"""
from __future__ import annotations

import concurrent.futures

from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.hicache import PREFETCHING, PROBED, PROBING
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.scheduler.request import Request
from tests.doubles.fake_link import drive
from tests.doubles.fake_worker import VOCAB, reference_output
from tests.unit.test_hicache_scheduler import EOS, DictStore, TieredFakeWorker

GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


class HeldProbe:
    """An ExistsProbe whose first `held` answers come when the test gives them (answer()),
    or never; the later ones are in at once."""
    probe_timeout_s = 0.5

    def __init__(self, store: dict, held: int = 1 << 30) -> None:
        self.dict_store, self.held = DictStore(store), held
        self.calls: list[tuple[list[bytes], float, int | None, concurrent.futures.Future]] = []

    def start_exists(self, keys: list[bytes], *, wait_s: float = 0.0,
                     claim_from: int | None = None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.append((list(keys), wait_s, claim_from, fut))
        if len(self.calls) > self.held:
            self.answer()
        return fut

    def answer(self, i: int = -1) -> None:
        """The store's answer to call i: what the dict store holds."""
        keys, _, _, fut = self.calls[i]
        fut.set_result(self.dict_store.exists(keys))


def make(store: dict, probe=None, **hc) -> tuple[Scheduler, TieredFakeWorker]:
    limits = ModelLimits(24, 1, 256, VOCAB, (EOS,), host_pages=24, page_bytes=100, model_identity="m",
                         weights_version="0", kv_layout="ids")
    cfg = HiCacheConfig(**{"hicache_prefetch_threshold": 1, "hicache_load_policy": "always", **hc})
    sched = Scheduler(SchedulerConfig(max_running_requests=4), limits, cfg, probe or DictStore(store))
    return sched, TieredFakeWorker(24, 24, 1, store)


def stored_prompt(store: dict, prompt: list[int]) -> None:
    """Another replica computed `prompt` and wrote it through to the shared store."""
    sched, worker = make(store)
    sched.submit("writer", prompt, GREEDY, seed=0)
    drive(sched, worker)


def waiting(sched: Scheduler, rid: str) -> Request:
    return next(r for r in sched.waiting if r.rid == rid)


def test_a_probing_request_waits_while_others_run_then_prefetches_what_the_answer_says():
    store: dict = {}
    prompt = list(range(1, 13))
    stored_prompt(store, prompt)
    probe = HeldProbe(store, held=1)  # a's answer is held, b's is in at once
    sched, worker = make(store, probe)
    sched.submit("a", prompt + [7], GREEDY, seed=0)
    sched.submit("b", [30, 31, 32], GREEDY, seed=0)
    plan = sched.schedule()
    assert [i.rid for i in plan.items] == ["b"]  # b is not held up by a's probe
    assert waiting(sched, "a").store_state == PROBING and len(probe.calls) == 2
    b_tokens = [t for o in sched.process(worker.execute(plan)) for t in o.token_ids]
    assert waiting(sched, "a").store_state == PROBING  # no answer yet: still not admitted
    probe.answer(0)
    plan = sched.schedule()  # the answer is in: a's prefix comes from the store first
    assert waiting(sched, "a").store_state == PREFETCHING and plan.kv_copies
    b_tokens += [t for o in sched.process(worker.execute(plan)) for t in o.token_ids]
    res = drive(sched, worker)
    assert res["a"][2] >= 12 and sched.stats.store_hit_tokens >= 12
    assert res["a"][0] == reference_output(prompt + [7], 4, (EOS,))
    assert b_tokens + res["b"][0] == reference_output([30, 31, 32], 4, (EOS,))


def test_an_answer_that_never_comes_is_a_miss_once_its_bound_passed():
    store: dict = {}
    prompt = list(range(1, 13))
    stored_prompt(store, prompt)
    probe = HeldProbe(store)
    sched, worker = make(store, probe, hicache_load_policy="never")  # no wait asked: bound = probe timeout
    now = [100.0]
    sched.hicache.probes.clock = lambda: now[0]
    sched.submit("a", prompt + [7], GREEDY, seed=0)
    assert sched.schedule() is None and waiting(sched, "a").store_state == PROBING
    now[0] += probe.probe_timeout_s  # the bound passes with no answer
    plan = sched.schedule()
    assert [i.rid for i in plan.items] == ["a"] and not plan.kv_copies
    assert probe.calls[0][3].cancelled() and sched.hicache.probes.timed_out == 1
    first = [t for o in sched.process(worker.execute(plan)) for t in o.token_ids]
    res = drive(sched, worker)
    assert res["a"][2] == 0 and first + res["a"][0] == reference_output(prompt + [7], 4, (EOS,))


def test_the_probe_claims_what_it_will_write_and_waits_no_longer_than_recomputing_costs():
    store: dict = {}
    probe = HeldProbe(store)
    sched, _ = make(store, probe, hicache_load_policy="auto")
    est = sched.hicache.estimates
    sched.submit("a", list(range(1, 20)), GREEDY, seed=0)
    sched.schedule()
    keys, wait_s, claim_from, _ = probe.calls[0]
    assert len(keys) == 18 and claim_from == 0  # nothing held: it will compute and write all 18
    assert wait_s == est.prefill_s(18) - est.transfer_s("store", 18 * 100) > 0
    est.prefill_tokens_per_s = 1e9  # recomputing is nearly free: waiting never pays
    sched.submit("b", list(range(2, 21)), GREEDY, seed=0)
    sched.schedule()
    assert probe.calls[1][1] == 0.0
    wb, _ = make(store, HeldProbe(store), hicache_write_policy="write_back")
    wb.submit("c", list(range(1, 20)), GREEDY, seed=0)
    wb.schedule()
    assert wb.hicache.probes.store.calls[0][2] is None  # write-back writes later: no claim


def test_an_aborted_request_drops_its_probe_and_a_synchronous_store_answers_at_once():
    store: dict = {}
    probe = HeldProbe(store)
    sched, worker = make(store, probe)
    sched.submit("a", list(range(1, 13)), GREEDY, seed=0)
    sched.schedule()
    sched.abort("a")
    sched.submit("b", list(range(20, 33)), GREEDY, seed=0)
    sched.schedule()  # a's abort applies; b's probe start drops a's
    assert probe.calls[0][3].cancelled() and len(sched.hicache.probes) == 1
    sync, _ = make(store)  # DictStore: answered within the schedule() that asked
    sync.submit("c", list(range(1, 13)), GREEDY, seed=0)
    plan = sync.schedule()
    assert [i.rid for i in plan.items] == ["c"] and sync.running["c"].store_state == PROBED
