"""What a routing policy sees and answers. Policies are pure: no I/O, no clock of their own
beyond what the tree uses, so unit tests drive them with plain lists.

The fleet (services/router/fleet.py) calls, from its event loop:
  choose(key, candidates) → Choice     once per attempt; candidates is non-empty, in a stable
                                       (address) order, and holds only replicas that may take work
  routed(key, address)                 after the attempt was sent there
  forget(address)                      the replica left the fleet
  maintain()                           on the router's eviction timer
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

BY_MATCH = "match"  # chosen for its prefix match (cache_aware only)
BY_LOAD = "load"    # chosen for its load, or by a policy that ignores prefixes


@dataclass(frozen=True)
class Candidate:
    address: str
    load: int  # requests in flight there (see Replica.load)


@dataclass(frozen=True)
class Choice:
    address: str
    reason: str  # BY_MATCH or BY_LOAD


class Policy(Protocol):
    name: str

    def choose(self, key: str, candidates: list[Candidate]) -> Choice: ...

    def routed(self, key: str, address: str) -> None: ...

    def forget(self, address: str) -> None: ...

    def maintain(self) -> None: ...


class Stateless:
    """Defaults for policies that keep no routing history."""

    def routed(self, key: str, address: str) -> None:
        pass

    def forget(self, address: str) -> None:
        pass

    def maintain(self) -> None:
        pass


def least_loaded(candidates: list[Candidate], turn: int = 0) -> Candidate:
    """The candidate with the lowest load; ties rotate with `turn` so equal replicas share work."""
    low = min(c.load for c in candidates)
    tied = [c for c in candidates if c.load == low]
    return tied[turn % len(tied)]
