"""Waiting-queue order: first come first served, or longest prefix match."""
from __future__ import annotations

from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Request


def order_waiting(waiting: list[Request], policy: str, cache: RadixCache | None,
                  lpm_fallback_queue_len: int) -> list[Request]:
    """The order in which waiting requests are considered for admission.

    `lpm` serves the requests with the most cached prefix first, so the cache
    is used before eviction takes it; matching every request is O(queue ×
    prompt), hence the fall back to fcfs for long queues. Retracted requests
    always go first: they already waited once.
    """
    if policy == "fcfs" or cache is None or len(waiting) > lpm_fallback_queue_len:
        return sorted(waiting, key=lambda r: (r.retractions == 0, r.arrival_time))

    def cached_len(r: Request) -> int:
        return cache.match_prefix(r.seq[: r.seq_len - 1], r.namespace).num_tokens

    return sorted(waiting, key=lambda r: (r.retractions == 0, -cached_len(r), r.arrival_time))
