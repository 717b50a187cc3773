"""The disk tier: one file per page under a directory, an LRU bounded by file bytes.

The index (key → file size, least recently used first) lives in memory and is
rebuilt from the directory at start: temp files of interrupted writes and
files that fail the cheap header/size check are deleted, the rest are ordered
by modification time (a hit touches its file, so recency survives a restart).
The payload's crc is verified on every read; a page that fails it is deleted
and reads as a miss.

Thread-safe: a lock guards the index; file reads and writes run outside it,
so reads of different pages proceed in parallel. A concurrent eviction or
clear may unlink a page being read: the reader then sees a miss.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from services.kvstore import page_file

log = logging.getLogger(__name__)


@dataclass
class DiskCounters:
    corrupt: int = 0   # pages found corrupt (read or scan) and deleted
    evicted: int = 0   # pages deleted to stay within capacity


class DiskTier:
    def __init__(self, root: Path | str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk capacity must be >= 0, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.counters = DiskCounters()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._lock = threading.Lock()
        self._generation = 0  # bumped by clear(): a write that started before it is dropped
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for path in self.root.glob("*/*"):
            if path.name.endswith(page_file.TMP_SUFFIX):
                _unlink(path)
                continue
            size = page_file.scan_page(path)
            key = page_file.key_of_path(path)
            if size is None or key is None or page_file.page_path(self.root, key) != path:
                self.counters.corrupt += 1
                _unlink(path)
                continue
            found.append((path.stat().st_mtime, key, size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self.bytes_used += size
        self._evict_over_budget()
        log.info("disk tier loaded", extra={"dir": str(self.root), "pages": len(self._index),
                                            "bytes": self.bytes_used, "corrupt_removed": self.counters.corrupt})

    def put(self, key: bytes, payload: bytes, crc: int) -> bool:
        """Write a page unless it is already stored; True when written."""
        size = page_file.HEADER_BYTES + len(key) + len(payload)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            generation = self._generation
        if size > self.capacity_bytes:
            return False
        path = page_file.page_path(self.root, key)
        try:
            page_file.write_page(path, key, payload, crc)
        except OSError as e:  # disk full, permissions: the page is simply not kept
            log.warning("page write failed", extra={"path": str(path), "error": str(e)})
            return False
        with self._lock:
            if generation != self._generation:  # cleared meanwhile
                _unlink(path)
                return False
            old = self._index.pop(key, None)  # a racing writer of the same key
            self.bytes_used += size - (old or 0)
            self._index[key] = size
            self._evict_over_budget()
        return True

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        """(payload, crc) of a stored page, marked most recently used; None on a
        miss. A corrupt or truncated page is deleted and reads as a miss."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = page_file.page_path(self.root, key)
        try:
            page = page_file.read_page(path, key)
        except OSError:  # evicted or cleared meanwhile, or removed behind our back
            self._forget(key)
            return None
        if page is None:
            log.warning("corrupt page removed", extra={"path": str(path)})
            with self._lock:
                self.counters.corrupt += 1
            self._forget(key)
            _unlink(path)
            return None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return page

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes_used -= size

    def _evict_over_budget(self) -> None:
        # caller holds the lock (or is the constructor)
        while self.bytes_used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.bytes_used -= size
            self.counters.evicted += 1
            _unlink(page_file.page_path(self.root, key))

    def clear(self) -> int:
        """Deletes every page (and stray temp files); returns how many were indexed."""
        with self._lock:
            self._generation += 1
            n = len(self._index)
            self._index.clear()
            self.bytes_used = 0
            for path in self.root.glob("*/*"):
                _unlink(path)
        return n

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_used == sum(self._index.values())
            assert self.bytes_used <= self.capacity_bytes


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:  # e.g. a directory where a page should be: leave it, say so
        log.warning("cannot remove", extra={"path": str(path), "error": str(e)})
