"""Rounds of a data-parallel-attention group (--enable-dp-attention): every rank's scheduler plans
on its own, and the ranks step together.

Each rank's plans queue in its inbox as its scheduler sends them (enqueue, from any thread). A
round takes the oldest plan of every rank that has one and runs them all at once on the group's
step thread (GroupRunner.execute_round: a rank with none runs its idle pass when another
computes). Whoever waits for a plan's result runs rounds on that thread until its plan has run
(result): so a round starts as soon as any rank has work, with no polling and no thread of its
own, and every rank's waiting plans join it. A round that fails fails every plan in it.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque


class DpRounds:
    def __init__(self, runner, size: int) -> None:
        """runner: the group's GroupRunner (execute_round); size: its data-parallel ranks."""
        self._runner = runner
        self._inboxes: list[deque] = [deque() for _ in range(size)]  # (ticket, plan), oldest first
        self._done: dict[int, object] = {}  # ticket → its StepResult, or the exception its round raised
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self.rounds = 0  # rounds run (tests, metrics)

    @property
    def size(self) -> int:
        return len(self._inboxes)

    def enqueue(self, rank: int, plan) -> int:
        """Queue rank `rank`'s next plan → its ticket for result()."""
        if not 0 <= rank < self.size:
            raise ValueError(f"data-parallel rank {rank} out of range 0..{self.size - 1}")
        with self._lock:
            ticket = next(self._tickets)
            self._inboxes[rank].append((ticket, plan))
        return ticket

    def result(self, ticket: int):
        """On the group's step thread: rounds until the ticket's plan has run → its StepResult
        (raises what its round raised)."""
        while ticket not in self._done:
            if not self._round():
                raise RuntimeError(f"data-parallel plan {ticket} is in no rank's inbox")
        out = self._done.pop(ticket)
        if isinstance(out, BaseException):
            raise out
        return out

    def _round(self) -> bool:
        """One round of every rank's oldest plan; False when no rank had one."""
        with self._lock:
            taken = [inbox.popleft() if inbox else None for inbox in self._inboxes]
        if not any(taken):
            return False
        plans = [t[1] if t else None for t in taken]
        try:
            results = self._runner.execute_round(plans)
        except Exception as exc:
            results = [exc] * len(plans)
        self.rounds += 1
        for t, out in zip(taken, results):
            if t is not None:
                self._done[t[0]] = out
        return True
