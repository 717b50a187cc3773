"""cache_aware (the default): prefix affinity from routing history, unless the fleet is imbalanced.

Per attempt:
  1. Imbalanced fleet — max load − min load > balance_abs_threshold AND
     max load > balance_rel_threshold × min load: send to the least loaded replica (BY_LOAD).
     Affinity concentrates load; this is the valve that lets a hot prefix overflow.
  2. Otherwise look the key up in the approximate tree (services/router/tree.py). If the
     best replica's match covers more than cache_threshold of the key, send it there
     (BY_MATCH; ties: the less loaded).
  3. Otherwise (a new prefix): the least loaded replica, ties to the one with the smallest
     tree, i.e. the most cache room (BY_LOAD).
The chosen replica is then recorded in the tree for the key, so the next request with the
same prefix follows it. The tree is trimmed to max_tree_chars per replica by maintain().
"""
from __future__ import annotations

from services.router.policies.base import BY_LOAD, BY_MATCH, Candidate, Choice
from services.router.tree import ApproxTree


class CacheAware:
    name = "cache_aware"

    def __init__(self, config, seed: int | None = None) -> None:  # a RouterConfig (or anything with its fields)
        self.cache_threshold = config.cache_threshold
        self.abs_threshold = config.balance_abs_threshold
        self.rel_threshold = config.balance_rel_threshold
        self.max_tree_chars = config.max_tree_chars
        self.tree = ApproxTree()
        self._turn = 0

    def imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo

    def choose(self, key: str, candidates: list[Candidate]) -> Choice:
        self._turn += 1
        if len(candidates) > 1 and self.imbalanced(candidates):
            return Choice(self._least_loaded(candidates).address, BY_LOAD)
        matches = self.tree.match(key)
        best = max(candidates, key=lambda c: (matches.get(c.address, 0), -c.load))
        matched = matches.get(best.address, 0)
        if key and matched / len(key) > self.cache_threshold:
            return Choice(best.address, BY_MATCH)
        return Choice(self._least_loaded(candidates).address, BY_LOAD)

    def _least_loaded(self, candidates: list[Candidate]) -> Candidate:
        low = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == low]
        room = min(self.tree.sizes.get(c.address, 0) for c in tied)
        tied = [c for c in tied if self.tree.sizes.get(c.address, 0) == room]
        return tied[self._turn % len(tied)]

    def routed(self, key: str, address: str) -> None:
        self.tree.insert(key, address)
        if self.tree.sizes.get(address, 0) > 2 * self.max_tree_chars:  # hard bound between timer ticks
            self.tree.evict(self.max_tree_chars)

    def forget(self, address: str) -> None:
        self.tree.remove_replica(address)

    def maintain(self) -> None:
        self.tree.evict(self.max_tree_chars)
