"""The memory tier: pages in an LRU bounded by their payload bytes.

Not thread-safe: `KVStore` serializes access with its lock. Eviction does not
drop pages itself: `put` returns what it pushed out, and the store spills it
to the disk tier.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Page:
    payload: bytes
    crc: int  # page_file.checksum(key, payload), computed once at put, checked on get, carried to disk


class MemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"memory capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._pages: OrderedDict[bytes, Page] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def keys(self) -> list[bytes]:
        return list(self._pages)

    def get(self, key: bytes) -> Page | None:
        """The page, marked most recently used; None when absent."""
        page = self._pages.get(key)
        if page is not None:
            self._pages.move_to_end(key)
        return page

    def discard(self, key: bytes, page: Page) -> bool:
        """Remove `key` if it still holds this very page (not a newer one put meanwhile)."""
        if self._pages.get(key) is not page:
            return False
        del self._pages[key]
        self.bytes_used -= len(page.payload)
        return True

    def put(self, key: bytes, page: Page) -> list[tuple[bytes, Page]]:
        """Insert (or refresh) `key`; returns the pages evicted to stay within
        capacity, least recently used first. A page larger than the whole
        capacity is not kept: it is returned as evicted at once."""
        old = self._pages.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old.payload)
        if len(page.payload) > self.capacity_bytes:
            return [(key, page)]
        self._pages[key] = page
        self.bytes_used += len(page.payload)
        evicted = []
        while self.bytes_used > self.capacity_bytes:
            k, p = self._pages.popitem(last=False)
            self.bytes_used -= len(p.payload)
            evicted.append((k, p))
        return evicted

    def clear(self) -> int:
        """Drops every page; returns how many there were."""
        n = len(self._pages)
        self._pages.clear()
        self.bytes_used = 0
        return n

    def check_invariants(self) -> None:
        assert self.bytes_used == sum(len(p.payload) for p in self._pages.values())
        assert self.bytes_used <= self.capacity_bytes
