"""Requests waiting for their grammar: the scheduler's grammar queue.

A constrained request whose grammar the worker may not have compiled yet waits here, not in
the waiting queue, so compilation never stalls a step: the driver takes the constraints to
prepare (`take_jobs`), asks the worker to compile each off its step thread, and reports back
(`prepared`), which releases the requests waiting for that grammar, in arrival order. Keys
known compiled are remembered (bounded like the worker's cache) so a repeated schema is
admitted at once; when the worker evicted it meanwhile, admission compiles it there (counted).
"""
from __future__ import annotations

from collections import OrderedDict

from services.common.grammar.constraint import Constraint
from services.scheduler.request import Request


class GrammarQueue:
    def __init__(self, remembered: int = 64) -> None:
        self.remembered = remembered
        self._ready: OrderedDict[str, None] = OrderedDict()  # keys compiled at the worker, oldest first
        self._waiting: dict[str, list[Request]] = {}  # key -> requests waiting for it
        self._jobs: dict[str, Constraint] = {}  # keys to ask the worker for
        self.prepared_count = 0

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values()))

    def held(self) -> list[Request]:
        """Every request waiting for its grammar."""
        return [r for reqs in self._waiting.values() for r in reqs]

    def is_ready(self, c: Constraint) -> bool:
        if c.key in self._ready:
            self._ready.move_to_end(c.key)
            return True
        return False

    def hold(self, req: Request) -> None:
        """Park `req` until its grammar is prepared."""
        c = req.sampling.constraint
        assert c is not None
        if c.key not in self._waiting:
            self._waiting[c.key] = []
            self._jobs[c.key] = c
        self._waiting[c.key].append(req)

    def take_jobs(self) -> list[Constraint]:
        jobs, self._jobs = list(self._jobs.values()), {}
        return jobs

    def prepared(self, key: str, ok: bool) -> list[Request]:
        """The worker compiled `key` (ok) or could not: the requests that waited for it."""
        if ok:
            self.prepared_count += 1
            self._ready[key] = None
            self._ready.move_to_end(key)
            while len(self._ready) > self.remembered:
                self._ready.popitem(last=False)
        return self._waiting.pop(key, [])

    def remove(self, rids: set[str]) -> list[Request]:
        """Take the waiting requests among `rids` out (aborted)."""
        removed = []
        for key, reqs in list(self._waiting.items()):
            removed += [r for r in reqs if r.rid in rids]
            reqs[:] = [r for r in reqs if r.rid not in rids]
            if not reqs:
                del self._waiting[key]
                self._jobs.pop(key, None)
        return removed

    def forget(self) -> None:
        """The worker's cache is gone (a new worker): nothing is known compiled."""
        self._ready.clear()
