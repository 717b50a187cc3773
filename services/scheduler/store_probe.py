"""The scheduler's questions to the kvstore, asked without blocking the scheduling loop.

`Scheduler.schedule()` runs on the scheduler service's event loop (and on the Engine's
loop thread). A store call made there stops every request for as long as the store
takes, up to the probe timeout (issue 33). So a probe is *started* (the store client
answers on its own thread) and *collected* by a later schedule() once the answer is in;
the request waits meanwhile (not admitted on that basis), the others go on. An answer
that does not come within `wait_s + probe_timeout_s` is cancelled and read as a miss.

Two kinds of store plug in:
- `ExistsProbe` (services/kvstore/blocking.BlockingKVStore): `start_exists` returns a
  future at once; it may wait at the store for pages another replica claimed (`wait_s`)
  and claim the pages this one will compute (`claim_from`), see services/kvstore/claims.py;
- `StoreProbe`, anything with a synchronous `exists(keys) -> int` (test doubles): its
  answer is in as soon as the probe starts, so nothing waits.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from services.scheduler.request import Request, Status

log = logging.getLogger(__name__)


class StoreProbe(Protocol):
    def exists(self, keys: list[bytes]) -> int:
        """How many leading keys the store holds (0 when it is unreachable)."""


class ExistsProbe(Protocol):
    probe_timeout_s: float  # how long an answer may take beyond the wait it asked for

    def start_exists(self, keys: list[bytes], *, wait_s: float = 0.0,
                     claim_from: int | None = None) -> concurrent.futures.Future:
        """A future of how many leading keys the store holds (0 when unreachable; never
        raises). wait_s: wait that long for keys another client claimed; claim_from: the
        caller will write keys[max(answer, claim_from):]."""


class _Answered:
    """A synchronous StoreProbe as an ExistsProbe: the future is done when returned."""
    probe_timeout_s = 0.0

    def __init__(self, store: StoreProbe) -> None:
        self.store = store

    def start_exists(self, keys: list[bytes], *, wait_s: float = 0.0,
                     claim_from: int | None = None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.store.exists(keys))
        return fut


def as_exists_probe(store: ExistsProbe | StoreProbe) -> ExistsProbe:
    return store if hasattr(store, "start_exists") else _Answered(store)  # type: ignore[arg-type]


@dataclass
class _Pending:
    future: concurrent.futures.Future
    deadline: float  # clock() after which the answer is a miss


class PendingProbes:
    """The probes in flight, one per waiting request."""

    def __init__(self, store: ExistsProbe | StoreProbe, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.clock = as_exists_probe(store), clock
        self._pending: dict[Request, _Pending] = {}
        self.timed_out = 0  # answers that did not come in time (read as misses)

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, req: Request, keys: list[bytes], wait_s: float, claim_from: int | None) -> None:
        """Ask the store about req's page keys (replacing a probe req already had)."""
        self._drop_finished()
        old = self._pending.pop(req, None)
        if old is not None:
            old.future.cancel()
        fut = self.store.start_exists(keys, wait_s=wait_s, claim_from=claim_from)
        self._pending[req] = _Pending(fut, self.clock() + wait_s + self.store.probe_timeout_s)

    def answer(self, req: Request) -> int | None:
        """req's answer once it is in (0 for a failed or late one); None while it may still come."""
        p = self._pending.get(req)
        if p is None:
            return 0
        if p.future.done():
            del self._pending[req]
            return _result(p.future)
        if self.clock() < p.deadline:
            return None
        del self._pending[req]
        p.future.cancel()
        self.timed_out += 1
        log.warning("kvstore probe unanswered in time; admitting as a miss", extra={"rid": req.rid})
        return 0

    def _drop_finished(self) -> None:
        """Probes of requests that ended while waiting (aborted): nobody collects them."""
        for req in [r for r in self._pending if r.status is Status.FINISHED]:
            self._pending.pop(req).future.cancel()


def _result(fut: concurrent.futures.Future) -> int:
    if fut.cancelled() or fut.exception() is not None:
        return 0
    return int(fut.result())
