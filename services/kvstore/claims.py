"""Claims: pages a replica is computing right now and will Put soon.

Why: write-through is asynchronous. A replica's pages reach the store a forward, a
step round trip and a ~20 MB transfer after its prefill, while the request's answer
reaches the client at once; the client's next request, routed to another replica,
asked `Exists` before the first pages landed and got a miss it recomputed (issue 33:
0 of 995 tokens found). With claims, the first prober of a chain that misses says it
will compute the rest (`claim_from`); a later prober from another client whose chain
stops at a claimed key waits (at most the `wait_s` it asked for, which it sets to what
recomputing would cost) until the pages land, then answers the longer prefix.

The wire: gRPC metadata on `Exists` (the proto is unchanged; an old store ignores it
and answers at once, an old client sends none and never waits):
  x-radixmesh-client      the caller's id (a client never waits on its own claims)
  x-radixmesh-wait-ms     how long to wait for claimed keys (0 = answer at once)
  x-radixmesh-claim-from  claim keys[max(answer, claim_from):] for this caller

A claim is a hint: it expires after `ttl_s`, and a key that lands (any Put of it)
releases it. A claim that is never kept (an aborted request) costs a later prober
at most its own wait. Single-threaded: the servicer's event loop owns it.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

CLIENT_HEADER = "x-radixmesh-client"
WAIT_HEADER = "x-radixmesh-wait-ms"
CLAIM_HEADER = "x-radixmesh-claim-from"


@dataclass(frozen=True)
class ProbeOptions:
    """What an Exists caller asks for beyond the answer (the metadata above)."""
    client: str = ""
    wait_s: float = 0.0
    claim_from: int | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """None of it for a plain probe (no wait, no claim)."""
        if not self.client or (self.wait_s <= 0 and self.claim_from is None):
            return ()
        md = [(CLIENT_HEADER, self.client)]
        if self.wait_s > 0:
            md.append((WAIT_HEADER, str(int(self.wait_s * 1000))))
        if self.claim_from is not None:
            md.append((CLAIM_HEADER, str(self.claim_from)))
        return tuple(md)

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> "ProbeOptions":
        """Unparseable values read as absent: a bad header must not fail a probe."""
        md = {k: v for k, v in metadata or () if isinstance(v, str)}
        try:
            wait_s = max(int(md.get(WAIT_HEADER, "0")), 0) / 1000
        except ValueError:
            wait_s = 0.0
        try:
            claim_from = int(md[CLAIM_HEADER]) if CLAIM_HEADER in md else None
        except ValueError:
            claim_from = None
        client = md.get(CLIENT_HEADER, "")
        return cls(client, wait_s if client else 0.0, claim_from if client else None)


class Claims:
    def __init__(self, ttl_s: float = 10.0, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """ttl_s: how long a claim holds without its page landing; max_keys: the oldest
        claims are forgotten beyond this many keys (each is ~150 bytes)."""
        if ttl_s <= 0 or max_keys <= 0:
            raise ValueError("ttl_s and max_keys must be > 0")
        self.ttl_s, self.max_keys, self.clock = ttl_s, max_keys, clock
        self._claims: OrderedDict[bytes, tuple[float, str]] = OrderedDict()  # key -> (expiry, client), oldest first
        self._landed: dict[bytes, asyncio.Event] = {}  # keys someone waits for
        self.waiting = 0  # Exists calls waiting now
        self.waits = 0  # waits for a claimed key, since start (an Exists waits once per page batch landing)
        self.claimed = 0  # keys claimed, since start
        self._waiters_changed: asyncio.Condition | None = None

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, keys: Sequence[bytes], client: str) -> None:
        """`client` will Put `keys` soon."""
        expiry = self.clock() + self.ttl_s
        for key in keys:
            self._claims[key] = (expiry, client)
            self._claims.move_to_end(key)
        self.claimed += len(keys)
        self._sweep()

    def _sweep(self) -> None:
        now = self.clock()
        while self._claims:
            key, (expiry, _) = next(iter(self._claims.items()))
            if expiry > now and len(self._claims) <= self.max_keys:
                return
            del self._claims[key]

    def held_by_other(self, key: bytes, client: str) -> float:
        """Seconds left on another client's claim of `key` (0: none)."""
        entry = self._claims.get(key)
        if entry is None or entry[1] == client:
            return 0.0
        return max(entry[0] - self.clock(), 0.0)

    def landed(self, keys: Iterable[bytes]) -> None:
        """A Put of `keys` finished: their claims are kept (stored, skipped or refused alike:
        a waiter looks again and stops waiting for a key that is still missing)."""
        for key in keys:
            self._claims.pop(key, None)
            event = self._landed.pop(key, None)
            if event is not None:
                event.set()

    async def wait(self, key: bytes, timeout: float) -> None:
        """Until `key` lands or `timeout` seconds pass."""
        event = self._landed.setdefault(key, asyncio.Event())
        self.waiting += 1
        self.waits += 1
        await self._notify()
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiting -= 1
            if not self.waiting:
                self._landed.clear()  # events of keys that never landed

    async def _notify(self) -> None:
        if self._waiters_changed is not None:
            async with self._waiters_changed:
                self._waiters_changed.notify_all()

    async def until_waits(self, n: int = 1) -> None:
        """Until `n` waits for claimed keys have begun since start (what tests synchronize on)."""
        if self._waiters_changed is None:
            self._waiters_changed = asyncio.Condition()
        async with self._waiters_changed:
            await self._waiters_changed.wait_for(lambda: self.waits >= n)
