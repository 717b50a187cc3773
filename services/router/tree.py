"""The router's approximate prefix tree: which replica probably holds which prompt prefix.

A replica's real prefix cache is in its scheduler; the router cannot see it, so it
remembers what it sent where. One compressed radix tree over routing keys (the
request's text, or its token ids as characters) is shared by all replicas; every
node records, per replica, when a key through it was last routed there. Because
`insert` marks the whole path, a replica present at a node is present at all of its
ancestors, so "how much of this key does replica R probably have cached" is the
depth of the deepest node on the key's path that still names R.

Sizes are counted in characters per replica (the sum of the edge lengths of the
nodes naming it); `evict(max_chars)` trims each replica down to `max_chars` by
removing it from its least recently routed leaves first (a node losing its last
replica is unlinked), which keeps the ancestors-closed property. Not thread-safe:
the router calls it from its event loop only.
"""
from __future__ import annotations

import heapq
import os
import time
from typing import Callable


class _Node:
    __slots__ = ("edge", "parent", "children", "replicas")

    def __init__(self, edge: str, parent: "_Node | None") -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge → child
        self.replicas: dict[str, float] = {}  # replica → last time a key through here went to it


def _common(a: str, b: str) -> int:
    return len(os.path.commonprefix((a, b)))


class ApproxTree:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._root = _Node("", None)
        self._clock = clock
        self.sizes: dict[str, int] = {}  # replica → characters it owns in the tree

    def insert(self, key: str, replica: str) -> None:
        """Record that `key` was routed to `replica` (marks every node on its path)."""
        now = self._clock()
        node, i = self._root, 0
        node.replicas[replica] = now
        self.sizes.setdefault(replica, 0)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = _Node(key[i:], node)
                node.children[key[i]] = child
            n = _common(child.edge, key[i:i + len(child.edge)])
            if n < len(child.edge):
                child = self._split(child, n)
            if replica not in child.replicas:
                self.sizes[replica] += len(child.edge)
            child.replicas[replica] = now
            node, i = child, i + len(child.edge)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n characters; returns the new upper node (same replicas)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:n], parent)
        upper.replicas = dict(child.replicas)  # sizes unchanged: the characters only moved
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def match(self, key: str) -> dict[str, int]:
        """Replica → how many leading characters of `key` it was routed (replicas with 0 are left out)."""
        out: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common(child.edge, key[i:i + len(child.edge)])
            for r in child.replicas:
                out[r] = i + n
            if n < len(child.edge):
                break
            node, i = child, i + n
        return out

    def evict(self, max_chars: int) -> int:
        """Trim every replica to at most max_chars, least recently routed leaves first.
        Returns how many characters were dropped."""
        dropped = 0
        for replica, size in list(self.sizes.items()):
            if size > max_chars:
                dropped += self._evict_replica(replica, size - max_chars)
        return dropped

    def _evict_replica(self, replica: str, excess: int) -> int:
        heap = [(n.replicas[replica], id(n), n) for n in self._nodes(replica) if self._is_leaf(n, replica)]
        heapq.heapify(heap)
        dropped = 0
        while heap and dropped < excess:
            _, _, node = heapq.heappop(heap)
            parent = node.parent  # before _drop, which may unlink node
            dropped += self._drop(node, replica)
            if parent is not None and parent is not self._root and self._is_leaf(parent, replica):
                heapq.heappush(heap, (parent.replicas[replica], id(parent), parent))
        return dropped

    def remove_replica(self, replica: str) -> None:
        """Forget a replica everywhere (it left the fleet)."""
        for node in sorted(self._nodes(replica), key=self._depth, reverse=True):  # leaves first
            self._drop(node, replica)
        self._root.replicas.pop(replica, None)
        self.sizes.pop(replica, None)

    def _drop(self, node: _Node, replica: str) -> int:
        del node.replicas[replica]
        self.sizes[replica] -= len(node.edge)
        if not node.replicas and node.parent is not None:
            # No replica here means none below either (ancestors-closed): unlink it.
            del node.parent.children[node.edge[0]]
            node.parent = None
        return len(node.edge)

    def _nodes(self, replica: str) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if replica in child.replicas:
                    out.append(child)
                    stack.append(child)
        return out

    @staticmethod
    def _is_leaf(node: _Node, replica: str) -> bool:
        return replica in node.replicas and not any(replica in c.replicas for c in node.children.values())

    @staticmethod
    def _depth(node: _Node) -> int:
        d = 0
        while node.parent is not None:
            node, d = node.parent, d + 1
        return d

    def check(self) -> None:
        """Invariants (tests call this): sizes match the nodes, ancestors-closed, edges non-empty."""
        counted: dict[str, int] = {r: 0 for r in self.sizes}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first and child.parent is node
                assert child.replicas, "a node naming no replica must be unlinked"
                for r in child.replicas:
                    assert node is self._root or r in node.replicas, f"{r} at a node but not at its parent"
                    counted[r] = counted.get(r, 0) + len(child.edge)
                stack.append(child)
        assert counted == self.sizes, (counted, self.sizes)
