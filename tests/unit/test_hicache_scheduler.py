"""HiCache in the scheduler core, against a model-free worker with a host pool and a store.

The fake worker's KV holds token ids (tests/doubles/fake_worker.py checks every read),
so a page demoted, loaded, prefetched or written back to the wrong place, or a
page reused while a copy still needs it, shows up as a wrong token.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.step.contract import DEVICE, HOST, STORE, KVTransferStat, StepPlan, StepResult
from tests.doubles.fake_link import drive
from tests.doubles.fake_worker import VOCAB, FakeWorker, reference_output

EOS = 0


class TieredFakeWorker:
    """FakeWorker plus a host pool and a store of token-id pages, running kv_copies."""

    def __init__(self, num_pages: int, host_pages: int, page_size: int, store: dict):
        self.inner = FakeWorker(num_pages, page_size)
        self.ps = page_size
        self.pools = {DEVICE: self.inner.slots, HOST: [-1] * (host_pages * page_size)}
        self.store = store  # key -> tuple of token ids
        self.lose_store_pages = False  # a store that loses pages between Exists and Get

    def _page(self, tier: str, page: int) -> list[int]:
        return self.pools[tier][page * self.ps:(page + 1) * self.ps]

    def execute(self, plan: StepPlan) -> StepResult:
        stats = []
        for op in plan.kv_copies:
            moved = len(op.src_pages)
            if op.dst_tier == STORE:
                for page, key in zip(op.src_pages, op.keys, strict=True):
                    self.store.setdefault(key, tuple(self._page(op.src_tier, page)))
            elif op.src_tier == STORE:
                moved = 0
                for page, key in zip(op.dst_pages, op.keys):
                    data = self.store.get(key)
                    if data is None or (self.lose_store_pages and random.random() < 0.3):
                        break
                    self.pools[op.dst_tier][page * self.ps:(page + 1) * self.ps] = data
                    moved += 1
            else:
                for s, d in zip(op.src_pages, op.dst_pages, strict=True):
                    self.pools[op.dst_tier][d * self.ps:(d + 1) * self.ps] = self._page(op.src_tier, s)
            stats.append(KVTransferStat(moved, moved * 100, 1e-6))
        result = self.inner.execute(plan)
        result.kv_transfers = stats
        return result


class DictStore:
    def __init__(self, store: dict):
        self.store = store

    def exists(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        return n


def make(num_pages=24, host_pages=24, page_size=1, store=None, adapter_model="m", **hc):
    limits = ModelLimits(num_pages, page_size, 256, VOCAB, (EOS,), host_pages=host_pages, page_bytes=100,
                         model_identity=adapter_model, weights_version="0", kv_layout="ids")
    cfg = HiCacheConfig(**{"hicache_prefetch_threshold": 1, "hicache_load_policy": "always", **hc})
    sched = Scheduler(SchedulerConfig(max_running_requests=4), limits, cfg,
                      DictStore(store) if store is not None else None)
    return sched, TieredFakeWorker(num_pages, host_pages, page_size, store if store is not None else {})


def run(sched, worker, rid_prompts, max_new=4):
    for rid, prompt in rid_prompts:
        sched.submit(rid, prompt, SamplingParams(temperature=0, max_new_tokens=max_new), seed=0)
    return drive(sched, worker)


def test_evicted_prefix_is_demoted_to_host_and_loaded_back():
    sched, worker = make(num_pages=16, host_pages=24)
    a = list(range(1, 11))
    res = run(sched, worker, [("a", a)])
    res |= run(sched, worker, [("b", list(range(20, 30)))])  # evicts a's pages: demoted, not dropped
    assert sched.stats.pages_demoted > 0 and sched.kv.cache.host_pages > 0
    res |= run(sched, worker, [("a2", a + [40])])
    assert res["a2"][2] >= 10 and sched.stats.host_hit_tokens >= 5
    assert res["a2"][0] == reference_output(a + [40], 4, (EOS,))


def test_store_prefix_is_prefetched_by_a_second_scheduler_and_adapters_never_mix():
    store: dict = {}
    s1, w1 = make(store=store)
    prompt = list(range(1, 13))
    run(s1, w1, [("a", prompt)])
    assert s1.stats.pages_written_to_store >= 11 and store
    s2, w2 = make(store=store)
    res = run(s2, w2, [("b", prompt + [5])])
    assert res["b"][2] >= 11 and s2.stats.store_hit_tokens >= 11
    assert res["b"][0] == reference_output(prompt + [5], 4, (EOS,))
    s3, w3 = make(store=store)  # same store, another adapter namespace: no hit
    s3.submit("c", prompt, SamplingParams(temperature=0, max_new_tokens=2), seed=0, namespace="lora-x")
    res = run(s3, w3, [])
    assert res["c"][2] == 0
    s4, w4 = make(store=store, adapter_model="other-model")  # another model: no hit
    assert run(s4, w4, [("d", prompt)])["d"][2] == 0


def test_write_back_writes_only_on_eviction_from_the_host_tier():
    store: dict = {}
    sched, worker = make(num_pages=16, host_pages=16, store=store, hicache_write_policy="write_back")
    run(sched, worker, [("a", list(range(1, 11)))])
    assert not store
    for i in range(4):  # push a's pages through the host tier and out
        run(sched, worker, [(f"x{i}", [30 + i] * 10)])
    assert store and sched.stats.pages_written_to_store > 0
    s2, w2 = make(store=store)
    res = run(s2, w2, [("a2", list(range(1, 11)) + [7])])
    assert res["a2"][2] > 0 and res["a2"][0] == reference_output(list(range(1, 11)) + [7], 4, (EOS,))


def test_auto_policy_recomputes_when_transfer_is_estimated_slower():
    store: dict = {}
    s1, w1 = make(store=store)
    run(s1, w1, [("a", list(range(1, 13)))])
    s2, w2 = make(store=store, hicache_load_policy="auto")
    s2.hicache.estimates.bytes_per_s[STORE] = 1.0  # 100 bytes a page: far slower than prefill
    res = run(s2, w2, [("b", list(range(1, 13)) + [3])])
    assert res["b"][2] == 0 and s2.stats.loads_skipped > 0 and s2.stats.bytes_store_to_host == 0


requests_st = st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, VOCAB - 1), max_size=8),
                                 st.integers(1, 6)), min_size=1, max_size=10)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(12, 30),
       host_pages=st.integers(0, 30), write=st.sampled_from(["write_through", "write_back"]),
       use_store=st.booleans(), lossy=st.booleans(), load=st.sampled_from(["always", "never", "auto"]),
       seed=st.integers(0, 1000), rounds=st.integers(1, 2))
def test_random_tiered_workloads_stay_exact(reqs, page_size, num_pages, host_pages, write, use_store, lossy,
                                            load, seed, rounds):
    """Any mix of demotion, loads, prefetches (some cut short by a lossy store),
    write-through/back and recompute: outputs exact, every invariant after every step,
    two schedulers sharing the store."""
    rng = random.Random(seed)
    random.seed(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    store = {} if use_store else None
    for r in range(rounds):
        sched, worker = make(num_pages=num_pages, host_pages=host_pages, page_size=page_size, store=store,
                             hicache_write_policy=write, hicache_load_policy=load)
        worker.lose_store_pages = lossy
        batch = []
        for i, (pfx, own, max_new) in enumerate(reqs):
            prompt = prefixes[pfx] + own
            if prompt and (len(prompt) + 6 + page_size - 1) // page_size <= num_pages:
                batch.append((f"r{r}-{i}", prompt))
        res = run(sched, worker, batch, max_new=6)
        for rid, prompt in batch:
            assert res[rid][0] == reference_output(prompt, 6, (EOS,)), rid
        kv = sched.kv
        assert kv.allocator.num_free + kv.cache.cached_pages == num_pages
        if kv.host_allocator is not None:
            assert kv.host_allocator.num_free + kv.cache.host_pages == kv.host_allocator.num_pages
