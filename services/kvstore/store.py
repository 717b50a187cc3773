"""The KV store core: memory LRU over a disk LRU, pages as opaque bytes under opaque keys.

    store = KVStore(StoreConfig(memory_bytes=1 << 30, disk_dir="/var/cache/kv", disk_bytes=10 << 30))
    store.put_many([(key, payload), ...])    # -> PutResult(stored, skipped, rejected)
    store.get_many(keys, stop_at_miss=True)  # -> [payload | None, ...] aligned with keys
    store.exists_prefix(keys)                # -> how many leading keys are stored

Tiers. A put lands in memory; pages the memory LRU evicts spill to disk (when
a disk directory is configured, else they are dropped). A disk hit is promoted
back into memory and keeps its file, so evicting it again costs no write. The
tiers overlap: `Stats` counts pages per tier, a page may be in both.

Transport-free and thread-safe (the service runs calls on worker threads):
one lock guards the memory tier; the disk tier has its own, and disk I/O never
runs under the store's lock. A page is in flight between the tiers for the
duration of its spill write; a get in that window misses (it is a cache).

Integrity: every page carries a crc32 over its key and payload, computed once
at put; memory hits are checked against it (outside the lock), disk reads check
the file's copy. A page that fails is never served: it is dropped from that
tier, counted in `Stats.corrupt`, logged, and reads as a miss, so the caller
recomputes it.

Keys are expected to be page_hash chain keys (so a chain's pages are stored
and looked up in order); the store only requires 1..255 bytes.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from services.kvstore.disk_tier import DiskTier
from services.kvstore.memory_tier import MemoryTier, Page
from services.kvstore.page_file import checksum

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 255


@dataclass(frozen=True)
class StoreConfig:
    memory_bytes: int = 1 << 30
    disk_dir: str | None = None   # None: no disk tier, memory evictions are dropped
    disk_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("memory and disk budgets must be >= 0 bytes")


@dataclass(frozen=True)
class PutResult:
    stored: int = 0    # new pages
    skipped: int = 0   # already stored (refreshed as recently used)
    rejected: int = 0  # bad key or empty payload


@dataclass
class Stats:
    memory_pages: int = 0
    memory_bytes: int = 0
    memory_capacity_bytes: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    hits_memory: int = 0
    hits_disk: int = 0
    misses: int = 0
    bytes_in: int = 0         # payload bytes accepted by put
    bytes_out: int = 0        # payload bytes returned by get
    pages_stored: int = 0
    pages_skipped: int = 0
    pages_rejected: int = 0
    spilled: int = 0          # memory evictions written to disk
    dropped: int = 0          # memory evictions with no disk tier to go to
    disk_evicted: int = 0     # pages deleted to keep the disk budget
    corrupt: int = 0          # pages that failed their checksum (either tier) or a file check, deleted


class KVStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.memory = MemoryTier(config.memory_bytes)
        self.disk = DiskTier(Path(config.disk_dir), config.disk_bytes) if config.disk_dir else None
        self._stats = Stats()  # the counters; sizes are filled in by stats()

    def put_many(self, pages: Iterable[tuple[bytes, bytes]]) -> PutResult:
        """Store pages; a key already stored (either tier) is skipped and refreshed."""
        stored = skipped = rejected = 0
        for key, payload in pages:
            if not 0 < len(key) <= MAX_KEY_BYTES or not payload:
                rejected += 1
                continue
            with self._lock:
                present = self.memory.get(key) is not None
            if present or (self.disk is not None and key in self.disk):
                skipped += 1
                continue
            page = Page(bytes(payload), checksum(key, payload))
            with self._lock:
                evicted = self.memory.put(key, page)
                self._stats.bytes_in += len(payload)
            self._spill(evicted)
            stored += 1
        with self._lock:
            self._stats.pages_stored += stored
            self._stats.pages_skipped += skipped
            self._stats.pages_rejected += rejected
        return PutResult(stored, skipped, rejected)

    def _spill(self, evicted: list[tuple[bytes, Page]]) -> None:
        spilled = dropped = 0
        for key, page in evicted:
            if self.disk is None:
                dropped += 1
            elif key in self.disk:  # a promoted page: its file is still there
                continue
            elif self.disk.put(key, page.payload, page.crc):
                spilled += 1
            else:
                dropped += 1
        if evicted:
            with self._lock:
                self._stats.spilled += spilled
                self._stats.dropped += dropped

    def get_many(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Payloads aligned with keys, None for a miss. With stop_at_miss, every
        key after the first miss reads as a miss without being looked up (a
        chain is only usable up to its first gap). A page that fails its checksum
        is never returned: it is dropped, counted in `corrupt`, and reads as a miss
        (unless the other tier holds an intact copy)."""
        out: list[bytes | None] = [None] * len(keys)
        hits_mem = hits_disk = misses = bytes_out = 0
        for i, key in enumerate(keys):
            page = self._memory_page(key)
            if page is not None:
                hits_mem += 1
            else:
                page = self._disk_page(key)
                hits_disk += page is not None
            if page is None:
                misses += 1
                if stop_at_miss:
                    misses += len(keys) - i - 1
                    break
                continue
            out[i] = page.payload
            bytes_out += len(page.payload)
        with self._lock:
            self._stats.hits_memory += hits_mem
            self._stats.hits_disk += hits_disk
            self._stats.misses += misses
            self._stats.bytes_out += bytes_out
        return out

    def _memory_page(self, key: bytes) -> Page | None:
        """The memory tier's page, verified outside the lock; a damaged one is dropped."""
        with self._lock:
            page = self.memory.get(key)
        if page is None or checksum(key, page.payload) == page.crc:
            return page
        log.warning("corrupt page dropped from memory", extra={"key": key.hex()})
        with self._lock:
            if self.memory.discard(key, page):  # not counted twice by racing readers
                self._stats.corrupt += 1
        return None

    def _disk_page(self, key: bytes) -> Page | None:
        """The disk tier's page (verified there), promoted into memory; its file stays."""
        if self.disk is None:
            return None
        found = self.disk.get(key)
        if found is None:
            return None
        page = Page(*found)
        with self._lock:
            evicted = self.memory.put(key, page)
        self._spill(evicted)
        return page

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (either tier). Does not touch recency
        and does not verify checksums: a corrupt page found by a later get makes
        that get return a shorter prefix."""
        n = 0
        for key in keys:
            with self._lock:
                present = key in self.memory
            if not present and not (self.disk is not None and key in self.disk):
                break
            n += 1
        return n

    def clear(self) -> int:
        """Empties both tiers; returns the number of distinct pages removed."""
        with self._lock:
            keys = set(self.memory.keys())
            self.memory.clear()
        if self.disk is not None:
            keys |= set(self.disk.keys())
            self.disk.clear()
        return len(keys)

    def stats(self) -> Stats:
        with self._lock:
            s = Stats(**vars(self._stats))
            s.memory_pages, s.memory_bytes = len(self.memory), self.memory.bytes_used
            s.memory_capacity_bytes = self.memory.capacity_bytes
        if self.disk is not None:
            s.disk_pages, s.disk_bytes = len(self.disk), self.disk.bytes_used
            s.disk_capacity_bytes = self.disk.capacity_bytes
            s.disk_evicted = self.disk.counters.evicted
            s.corrupt += self.disk.counters.corrupt
        return s

    def check_invariants(self) -> None:
        with self._lock:
            self.memory.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
