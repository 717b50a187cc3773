"""random: a uniformly random candidate (seedable for tests)."""
from __future__ import annotations

import random

from services.router.policies.base import BY_LOAD, Candidate, Choice, Stateless


class Random(Stateless):
    name = "random"

    def __init__(self, config=None, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, key: str, candidates: list[Candidate]) -> Choice:
        return Choice(self._rng.choice(candidates).address, BY_LOAD)
