"""round_robin: each attempt to the next candidate in address order; ignores load and prefixes."""
from __future__ import annotations

from services.router.policies.base import BY_LOAD, Candidate, Choice, Stateless


class RoundRobin(Stateless):
    name = "round_robin"

    def __init__(self, config=None, seed: int | None = None) -> None:
        self._turn = 0

    def choose(self, key: str, candidates: list[Candidate]) -> Choice:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Choice(chosen.address, BY_LOAD)
