"""The store's Prometheus metrics, read from its counters at scrape time (no hot-path cost).

Sizes are gauges labelled by tier; hits, misses and bytes moved are counters.
The store serves every model, so `model_name` is empty.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry

from services.common.metrics import LiveCollector
from services.kvstore.claims import Claims
from services.kvstore.store import KVStore


def read_metrics(store: KVStore | None, claims: Claims | None = None) -> dict[str, tuple[str, str, float]] | None:
    if store is None:  # still opening the disk directory
        return None
    s = store.stats()
    return {
        **(claim_metrics(claims) if claims is not None else {}),
        "kvstore_memory_bytes": ("gauge", "payload bytes in the memory tier", s.memory_bytes),
        "kvstore_memory_pages": ("gauge", "pages in the memory tier", s.memory_pages),
        "kvstore_memory_capacity_bytes": ("gauge", "memory tier budget", s.memory_capacity_bytes),
        "kvstore_disk_bytes": ("gauge", "file bytes in the disk tier", s.disk_bytes),
        "kvstore_disk_pages": ("gauge", "pages in the disk tier", s.disk_pages),
        "kvstore_disk_capacity_bytes": ("gauge", "disk tier budget", s.disk_capacity_bytes),
        "kvstore_hits_memory": ("counter", "pages returned from memory", s.hits_memory),
        "kvstore_hits_disk": ("counter", "pages returned from disk", s.hits_disk),
        "kvstore_misses": ("counter", "pages asked for and not returned", s.misses),
        "kvstore_bytes_in": ("counter", "payload bytes of new pages stored", s.bytes_in),
        "kvstore_bytes_out": ("counter", "payload bytes returned", s.bytes_out),
        "kvstore_spilled": ("counter", "memory evictions written to disk", s.spilled),
        "kvstore_disk_evicted": ("counter", "pages deleted to keep the disk budget", s.disk_evicted),
        "kvstore_corrupt": ("counter", "corrupt or truncated pages found and deleted", s.corrupt),
    }


def claim_metrics(claims: Claims) -> dict[str, tuple[str, str, float]]:
    """services/kvstore/claims.py: how often probes wait for pages other replicas are writing."""
    return {
        "kvstore_claimed_keys": ("gauge", "keys claimed by a client that is computing them", len(claims)),
        "kvstore_exists_waiting": ("gauge", "Exists calls waiting for claimed pages now", claims.waiting),
        "kvstore_exists_waits": ("counter", "waits of Exists calls for claimed pages", claims.waits),
        "kvstore_claims": ("counter", "keys claimed", claims.claimed),
    }


def make_registry(store: Callable[[], KVStore | None], claims: Claims | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(LiveCollector(lambda: "", lambda: read_metrics(store(), claims)))
    return registry
