"""power_of_two: sample two distinct candidates at random, send to the less loaded one
(the classic "power of two choices": near least-load balance without herding on one replica
when loads are stale)."""
from __future__ import annotations

import random

from services.router.policies.base import BY_LOAD, Candidate, Choice, Stateless


class PowerOfTwo(Stateless):
    name = "power_of_two"

    def __init__(self, config=None, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, key: str, candidates: list[Candidate]) -> Choice:
        if len(candidates) == 1:
            return Choice(candidates[0].address, BY_LOAD)
        a, b = self._rng.sample(candidates, 2)
        return Choice((b if b.load < a.load else a).address, BY_LOAD)
