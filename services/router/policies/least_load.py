"""least_load: the candidate with the fewest requests in flight (ties take turns)."""
from __future__ import annotations

from services.router.policies.base import BY_LOAD, Candidate, Choice, Stateless, least_loaded


class LeastLoad(Stateless):
    name = "least_load"

    def __init__(self, config=None, seed: int | None = None) -> None:
        self._turn = 0

    def choose(self, key: str, candidates: list[Candidate]) -> Choice:
        self._turn += 1
        return Choice(least_loaded(candidates, self._turn).address, BY_LOAD)
