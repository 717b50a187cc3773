"""The scheduler's counters, and its refusal when full (what it emits per request: services/common/outputs.py)."""
from __future__ import annotations

from dataclasses import dataclass


class QueueFull(RuntimeError):
    """The waiting queue is at its request or token limit: retry later (HTTP 503)."""


@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0  # not free: running requests' plus cached pages
    kv_pages_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    retracted: int = 0
    aborted: int = 0
    finished: int = 0
    steps: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without a model step of their own
    schedule_seconds: float = 0.0  # the scheduler's own CPU time, summed
    # Speculative decoding: steps with a speculative verify item, those items, tokens drafted and
    # accepted, and the worker's seconds drafting and running the steps that verified.
    spec_steps: int = 0
    spec_verify_items: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # HiCache: the host tier (gauges) and the moves between tiers (counters).
    host_pages_total: int = 0
    host_pages_cached: int = 0
    host_hit_tokens: int = 0  # prefix tokens loaded host -> device instead of recomputed
    store_hit_tokens: int = 0  # prefix tokens prefetched store -> host
    loads_skipped: int = 0  # lower-tier hits recomputed because prefill was estimated faster
    pages_demoted: int = 0  # device -> host on eviction
    pages_dropped: int = 0  # left the worker's tiers (device with no host room, host evictions)
    pages_written_to_store: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_store_to_host: int = 0
    bytes_to_store: int = 0
    transfer_seconds: float = 0.0  # the worker's time in KV copies, summed
    # Running estimates behind the load-or-recompute decision.
    est_prefill_tokens_per_s: float = 0.0
    est_host_bytes_per_s: float = 0.0
    est_store_bytes_per_s: float = 0.0

    @property
    def token_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
