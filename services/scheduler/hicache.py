"""HiCache, the scheduler's side: which pages move between tiers, and when.

The radix tree (radix_cache.py) records where each node's pages live (device or
host) and emits the copies that eviction and loading imply. This module adds the
kvstore below the host tier:

- keys: a request's full pages are named by a hash chain (services/common/page_hash)
  rooted in the model identity, weights version, adapter (the request's namespace),
  page size and KV layout, so a page is never served to another model or adapter;
- probe + prefetch: a waiting request asks the store how much of its prefix it
  holds, without blocking the loop (services/scheduler/store_probe.py: the request
  waits, unadmitted, until the answer is in or its bound passed, which reads as a
  miss); the store may hold the answer back while another replica is still writing
  pages of that prefix, for as long as waiting beats recomputing (`store_wait_s`),
  and under write-through the probe claims the pages this replica will compute, so
  the others wait for them in turn (services/kvstore/claims.py). When the answer
  exceeds what the worker's tiers hold by at least the threshold (and loading beats
  recomputing), host pages are reserved and a store -> host copy is sent; the
  request waits until the worker reports how many pages arrived, which are then
  inserted into the tree as host nodes (a short or failed load only makes the hit
  shorter);
- write policy: write-through sends every newly computed full page to the store
  (pages the probe found there are skipped); write-back lets the tree write pages
  when they leave its lowest tier;
- the load-or-recompute decision: running estimates of prefill tokens/s and of each
  tier's bytes/s, from the worker's measured step and transfer times.

No transport here: the store is an ExistsProbe (`start_exists(keys) -> future`) or
anything with `exists(keys) -> int` (store_probe.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.hicache_config import HiCacheConfig
from services.scheduler.outputs import SchedulerStats
from services.scheduler.page_keys import PageKeys
from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Request
from services.scheduler.store_probe import ExistsProbe, PendingProbes, StoreProbe  # noqa: F401 - StoreProbe: its old home
from services.step.contract import DEVICE, HOST, STORE, KVCopy, KVTransferStat, StepPlan

PROBING, PROBED, PREFETCHING = "probing", "probed", "prefetching"
MAX_STORE_WAIT_S = 2.0  # the longest a probe waits for pages another replica is writing


@dataclass
class Estimates:
    """Exponential moving averages of the measured rates (start: rough priors for a
    CPU box; the first measurements replace most of them)."""
    prefill_tokens_per_s: float = 1000.0
    bytes_per_s: dict[str, float] = field(default_factory=lambda: {HOST: 2e9, STORE: 1.5e8})
    latency_s: dict[str, float] = field(default_factory=lambda: {HOST: 0.0, STORE: 0.002})
    alpha: float = 0.3

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            self.prefill_tokens_per_s += self.alpha * (tokens / seconds - self.prefill_tokens_per_s)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 16 and seconds > 0:
            self.bytes_per_s[tier] += self.alpha * (nbytes / seconds - self.bytes_per_s[tier])

    def transfer_s(self, tier: str, nbytes: int) -> float:
        return self.latency_s[tier] + nbytes / self.bytes_per_s[tier]

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s


@dataclass
class _Prefetch:
    req: Request
    first_page: int  # the request's page index the load starts at
    host_pages: list[int]


class HiCache:
    def __init__(self, config: HiCacheConfig, cache: RadixCache, keys: PageKeys, page_bytes: int,
                 store: ExistsProbe | StoreProbe | None, stats: SchedulerStats):
        self.config, self.cache, self.keys = config, cache, keys
        self.page_size, self.page_bytes = cache.page_size, page_bytes
        self.store, self.stats = store, stats
        self.probes = PendingProbes(store) if store is not None else None
        self.max_store_wait_s = MAX_STORE_WAIT_S
        self.write_through = store is not None and config.hicache_write_policy == "write_through"
        self.estimates = Estimates()
        self._prefetches: dict[int, _Prefetch] = {}  # id(KVCopy) -> what it loads
        self._sent: list[KVCopy] = []  # the copies of the plan in flight
        self._publish_estimates()

    # --- decisions ----------------------------------------------------------------------
    def should_load(self, tier: str, tokens: int) -> bool:
        """Load `tokens` from `tier` rather than recompute them? Counts the no's."""
        policy = self.config.hicache_load_policy
        if policy != "auto":
            ok = policy == "always"
        else:
            nbytes = tokens // self.page_size * self.page_bytes
            ok = self.estimates.transfer_s(tier, nbytes) < self.estimates.prefill_s(tokens)
        if not ok:
            self.stats.loads_skipped += 1
        return ok

    def store_wait_s(self, tokens: int) -> float:
        """How long a probe may wait for `tokens` that another replica is still writing to
        the store: as long as waiting and then loading them beats recomputing them."""
        if self.config.hicache_load_policy == "never" or tokens < max(self.config.hicache_prefetch_threshold, 1):
            return 0.0
        nbytes = tokens // self.page_size * self.page_bytes
        spare = self.estimates.prefill_s(tokens) - self.estimates.transfer_s(STORE, nbytes)
        return min(max(spare, 0.0), self.max_store_wait_s)

    def probe(self, req: Request) -> None:
        """A waiting request's look at the store, never blocking: the first call starts the
        store's Exists (req is PROBING: not admitted), a later one takes the answer once it
        is in (a miss once its bound passed) and maybe starts a prefetch."""
        if req.store_state == PROBING:
            stored = self.probes.answer(req)  # type: ignore[union-attr]
            if stored is not None:
                self._probed(req, stored)
            return
        req.store_state = PROBED
        cache, ps = self.cache, self.page_size
        if self.probes is None or cache.disable or cache.host is None:
            return
        n_full = (req.seq_len - 1) // ps  # the last token always runs (its logits are sampled)
        if n_full == 0:
            return
        have = self._held_pages(req)
        claim_from = have if self.write_through else None  # the pages this replica will compute and write
        req.store_state = PROBING
        self.probes.start(req, self.keys.request_keys(req, n_full), self.store_wait_s((n_full - have) * ps),
                          claim_from)
        self.probe(req)  # a synchronous store has answered already

    def _held_pages(self, req: Request) -> int:
        """Pages of req's prefix the worker's tiers (device and host) hold now."""
        hit = self.cache.match_prefix(req.seq[:req.seq_len - 1], req.namespace)
        return (hit.num_tokens + hit.host_tokens) // self.page_size

    def _probed(self, req: Request, stored: int) -> None:
        """The store holds req's first `stored` pages: prefetch them when that pays."""
        req.store_state = PROBED
        req.store_pages = stored
        cache, ps = self.cache, self.page_size
        hit = cache.match_prefix(req.seq[:req.seq_len - 1], req.namespace)
        have = (hit.num_tokens + hit.host_tokens) // ps
        gain = stored - have
        if gain <= 0 or gain * ps < self.config.hicache_prefetch_threshold:
            return
        if not self.should_load(STORE, gain * ps):
            return
        host = cache.host
        if host.num_free < gain:  # keep what already matched while making room
            deepest = hit.host_nodes[-1] if hit.host_nodes else hit.node
            cache.inc_lock(deepest)
            cache.evict_host(gain - host.num_free)
            cache.dec_lock(deepest)
        pages = host.alloc(gain)
        if pages is None:
            return
        keys = self.keys.request_keys(req, stored)
        op = KVCopy(STORE, HOST, [], pages, keys[have:stored])
        cache.copies.append(op)
        self._prefetches[id(op)] = _Prefetch(req, have, pages)
        req.store_state = PREFETCHING

    def written(self, req: Request, lo: int, hi: int) -> None:
        """req's pages [lo, hi) were just handed to the tree, freshly computed:
        write-through sends those the store does not hold yet."""
        if not self.write_through:
            return
        lo = max(lo, req.store_pages)
        if hi <= lo:
            return
        keys = self.keys.request_keys(req, hi)[lo:hi]
        self.cache.copies.append(KVCopy(DEVICE, STORE, list(req.pages[lo:hi]), [], keys))
        self.stats.pages_written_to_store += hi - lo
        req.store_pages = hi

    # --- the plan's copies --------------------------------------------------------------
    def take_copies(self, plan: StepPlan | None) -> bool:
        """Move the copies decided since the last plan into `plan` (None: only say
        whether there are any). They must travel in the next plan, in order."""
        if plan is None:
            return bool(self.cache.copies)
        plan.kv_copies, self.cache.copies = self.cache.copies, []
        return bool(plan.kv_copies)

    def completed(self, sent: list[KVCopy], transfers: list[KVTransferStat] | None) -> None:
        """The worker ran a plan's copies `sent` (transfers None: the step failed, nothing moved)."""
        transfers = transfers or []
        s, est = self.stats, self.estimates
        for i, op in enumerate(sent):
            stat = transfers[i] if i < len(transfers) else KVTransferStat()
            s.transfer_seconds += stat.seconds
            route = (op.src_tier, op.dst_tier)
            if route == (DEVICE, HOST):
                s.bytes_device_to_host += stat.bytes
            elif route == (HOST, DEVICE):
                s.bytes_host_to_device += stat.bytes
                est.observe_transfer(HOST, stat.bytes, stat.seconds)
            elif op.src_tier == STORE:
                s.bytes_store_to_host += stat.bytes
                est.observe_transfer(STORE, stat.bytes, stat.seconds)
            elif op.dst_tier == STORE:
                s.bytes_to_store += stat.bytes
            pf = self._prefetches.pop(id(op), None)
            if pf is not None:
                self._finish_prefetch(pf, min(stat.pages, len(pf.host_pages)))
        self._publish_estimates()

    def observe_step(self, plan: StepPlan, forward_seconds: float, transfers: list[KVTransferStat]) -> None:
        """Prefill speed from a step that ran prefill chunks (decode rows are cheap next to them)."""
        tokens = sum(len(it.input_ids) for it in plan.items)
        if tokens > len(plan.items):
            self.estimates.observe_prefill(tokens, forward_seconds - sum(t.seconds for t in transfers))

    def _finish_prefetch(self, pf: _Prefetch, loaded: int) -> None:
        req, ps = pf.req, self.page_size
        self.cache.host.free(pf.host_pages[loaded:])  # type: ignore[union-attr]
        if loaded:
            self.cache.insert_host(req.seq, pf.host_pages[:loaded], pf.first_page, req.namespace)
            self.stats.store_hit_tokens += loaded * ps
        if loaded < len(pf.host_pages):  # the store lost pages (evicted, damaged, down): recompute them
            req.store_pages = min(req.store_pages, pf.first_page + loaded)
        if req.store_state == PREFETCHING:
            req.store_state = PROBED

    def inflight_host_pages(self) -> int:
        return sum(len(pf.host_pages) for pf in self._prefetches.values())

    def _publish_estimates(self) -> None:
        s, est = self.stats, self.estimates
        s.est_prefill_tokens_per_s = est.prefill_tokens_per_s
        s.est_host_bytes_per_s = est.bytes_per_s[HOST]
        s.est_store_bytes_per_s = est.bytes_per_s[STORE]
