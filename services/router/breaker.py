"""A per-replica circuit breaker: closed → open after N consecutive failures → half-open
after a cooldown (one trial attempt) → closed on its success, open again on its failure."""
from __future__ import annotations

import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # for the circuit-state gauge


class Breaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.cooldown_s, self._clock = failures, cooldown_s, clock
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_out = False  # half-open: the one trial attempt is in flight
        self.opened = 0  # times it opened

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state, self._trial_out = HALF_OPEN, False
        return self._state

    def available(self) -> bool:
        """May an attempt go there now? No side effect (see attempt())."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial_out)

    def attempt(self) -> None:
        """An attempt was sent: in half-open it is the trial, and no other goes until it ends."""
        if self.state == HALF_OPEN:
            self._trial_out = True

    def abandoned(self) -> None:
        """An attempt ended with no verdict on the replica (the client went away, bad input): if it
        was the half-open trial, the next attempt is the trial instead."""
        if self._state == HALF_OPEN:
            self._trial_out = False

    def success(self) -> None:
        self._state, self._failures, self._trial_out = CLOSED, 0, False

    def failure(self) -> None:
        self._failures += 1
        if self.state == HALF_OPEN or self._failures >= self.threshold:
            if self._state != OPEN:
                self.opened += 1
            self._state, self._opened_at, self._trial_out = OPEN, self._clock(), False
