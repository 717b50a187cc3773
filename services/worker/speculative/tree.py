"""A draft tree: several candidate continuations verified in one target forward (EAGLE).

A chain draft [d1, d2, ...] bets on one continuation; a tree shares prefixes between several
(node 0 is the root, the request's last true token; every other node is one draft token whose
parent is the token before it). The target runs all n + 1 tokens as one verify item under a tree
attention mask (services/worker/attention/torch_backend.py), node i at RoPE position
start + depth(i) but written to KV slot position start + i: the flattened order, parents before
children. After sampling, `accept` walks from the root along the children the target agrees
with; the accepted nodes' K/V then move to positions start + depth (`compaction_slots`,
KVPool.move_slots) so the request's KV is contiguous again. A chain is the tree whose node i's
parent is i - 1: its mask is the causal one and accept is jump_forward.accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Nodes 1..n in flattened order; node 0, the root, is the last true token (not listed)."""

    tokens: list[int]  # [n] node i's token at tokens[i - 1]
    parents: list[int]  # [n] parents[i - 1] = node i's parent (0 = root), always < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} is not an earlier node (0 <= parent < {i}): "
                                 "list parents before their children")

    @property
    def n(self) -> int:
        """Draft nodes, the root excluded (the verify item has n + 1 tokens)."""
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """The tree of a plain draft: node i's parent is node i - 1."""
        return cls(list(tokens), list(range(len(tokens))))

    def is_chain(self) -> bool:
        return self.parents == list(range(self.n))

    def truncated(self, n: int) -> "DraftTree":
        """The first n nodes: parents come first, so a prefix of the flattened order is a tree."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def depths(self) -> list[int]:
        """[n + 1] depth of node 0..n (root 0): node i's RoPE offset from the root."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return d

    def ancestor_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: [i, j] = node j is node i itself or one of its ancestors
        (what node i's query attends among the item's tokens)."""
        m = torch.eye(self.n + 1, dtype=torch.bool)
        for i, p in enumerate(self.parents, start=1):
            m[i] |= m[p]
        return m

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` ([] for the root): the draft prefix
        node's row of logits follows, i.e. what its sampler row must see as already generated."""
        out = []
        while node:
            out.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return out[::-1]

    def accept(self, picks: list[int]) -> tuple[list[int], list[int]]:
        """picks [n + 1]: the target's token at each node (the token after that node's path)
        → (tokens produced: the accepted nodes' tokens then the pick after the last of them, as
        jump_forward.accepted; the accepted nodes in root-to-leaf order, the root excluded).
        Siblings with the same token: the first in flattened order is followed."""
        if len(picks) != self.n + 1:
            raise ValueError(f"accept needs one pick per node: {len(picks)} for {self.n + 1} nodes")
        child: dict[tuple[int, int], int] = {}
        for i in range(self.n, 0, -1):  # backwards, so the first sibling's entry wins
            child[(self.parents[i - 1], self.tokens[i - 1])] = i
        produced, nodes, at = [], [], 0
        while True:
            produced.append(picks[at])
            at = child.get((at, picks[at]), 0)
            if not at:
                return produced, nodes
            nodes.append(at)


def compaction_moves(nodes: list[int]) -> tuple[list[int], list[int]]:
    """Accepted nodes (DraftTree.accept's second list) → (src, dst) offsets from the item's start
    position for the K/V moves that make the request's KV contiguous: node nodes[k] sits at
    start + nodes[k] and belongs at start + k + 1. Nodes already in place are left out; every
    dst < its src (a node's index is at least its depth), so moves never clobber a later source
    once sources are gathered first (KVPool.move_slots does)."""
    moves = [(node, k + 1) for k, node in enumerate(nodes) if node != k + 1]
    return [s for s, _ in moves], [d for _, d in moves]


def compaction_slots(page_row: torch.Tensor, page_size: int, start: int,
                     nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """compaction_moves as KV slots through one request's page-table row [P] → (src [m], dst [m])
    int64, for KVPool.move_slots. m may be 0 (a chain, or a tree accepted along its first path)."""
    src, dst = compaction_moves(nodes)
    pos = torch.tensor([start + s for s in src] + [start + d for d in dst], dtype=torch.int64)
    slots = page_row[pos // page_size] * page_size + pos % page_size  # (the attention layout's slots_of)
    return slots[:len(src)], slots[len(src):]
