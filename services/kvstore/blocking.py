"""KVStoreClient for synchronous callers (the Engine's thread, the worker's step).

The client is async and bound to one event loop; this runs one on a daemon
thread and calls into it. Like the client it never raises for the store's sake:
a store that is down, slow or past the caller's wait answers misses. Writes are
fire-and-forget (a cache write must not hold up the forward) with a cap on the
bytes in flight; beyond it a write is dropped, which only costs a later miss.

`exists` blocks the caller for up to probe_timeout_s; an event loop's caller (the
scheduler service) uses `start_exists` instead, which returns a future at once
(services/scheduler/store_probe.py polls it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Sequence

import torch

from services.kvstore.client import KVStoreClient
from services.kvstore.page_codec import PageSpec

log = logging.getLogger(__name__)


class BlockingKVStore:
    def __init__(self, address: str, spec: PageSpec, *, timeout_s: float = 2.0, probe_timeout_s: float = 0.5,
                 retry_interval_s: float = 1.0, max_pending_bytes: int = 256 << 20,
                 auth_token: str | None = None) -> None:
        self.address, self.spec = address, spec
        self.probe_timeout_s, self.max_pending_bytes = probe_timeout_s, max_pending_bytes
        self.client = KVStoreClient(address, spec, timeout_s=timeout_s, retry_interval_s=retry_interval_s,
                                    auth_token=auth_token)
        self.dropped_puts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._pending: dict[concurrent.futures.Future, int] = {}  # put -> its bytes

    def _wait(self, coro, timeout: float | None, miss):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except Exception as exc:  # the client answers misses itself; this is our own wait running out
            fut.cancel()
            log.warning("kvstore call gave up; answering a miss", extra={"address": self.address, "error": repr(exc)})
            return miss

    def exists(self, keys: list[bytes]) -> int:
        """Leading keys stored; 0 when the store is unreachable or slower than probe_timeout_s."""
        if not keys:
            return 0
        return self._wait(self.client.exists(keys), self.probe_timeout_s, 0)

    def start_exists(self, keys: list[bytes], *, wait_s: float = 0.0,
                     claim_from: int | None = None) -> concurrent.futures.Future:
        """Start an Exists and return at once: a future of the leading keys stored (0 when
        the store is unreachable; it never raises, and cancelling it cancels the call).
        wait_s, claim_from: see KVStoreClient.exists. The caller bounds the wait
        (probe_timeout_s past wait_s is what `exists` would allow)."""
        if not keys:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        return asyncio.run_coroutine_threadsafe(
            self.client.exists(keys, wait_s=wait_s, claim_from=claim_from), self._loop)

    def get_prefix(self, keys: Sequence[bytes]) -> torch.Tensor:
        """[m, L, 2, P, Hkv, D], m <= len(keys): the longest stored prefix (m = 0 on failure)."""
        empty = torch.empty((0, *self.spec.shape), dtype=self.spec.dtype)
        if not keys:
            return empty
        deadline = self.client._deadline(len(keys) * self.spec.nbytes) + 1.0
        return self._wait(self.client.get_prefix(list(keys)), deadline, empty)

    def put_nowait(self, keys: Sequence[bytes], pages: torch.Tensor) -> bool:
        """Queue a write of pages [n, L, 2, P, Hkv, D] (a tensor nobody else writes).
        False when too many bytes are already in flight: the write is dropped."""
        nbytes = pages.numel() * pages.element_size()
        with self._lock:
            if self._pending and sum(self._pending.values()) + nbytes > self.max_pending_bytes:
                self.dropped_puts += 1
                return False
            fut = asyncio.run_coroutine_threadsafe(self.client.put(list(keys), pages), self._loop)
            self._pending[fut] = nbytes
        fut.add_done_callback(self._done)
        return True

    def _done(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.pop(fut, None)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        with self._lock:
            futs = list(self._pending)
        concurrent.futures.wait(futs, timeout=timeout)

    def clear(self) -> int | None:
        return self._wait(self.client.clear(), 30.0, None)

    def stats(self):
        return self._wait(self.client.stats(), 10.0, None)

    def close(self) -> None:
        self.flush(timeout=10.0)
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(5.0)
        except Exception:  # closing a channel to a dead store: nothing to keep
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
