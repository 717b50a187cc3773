"""The runner's side of tree drafts and of drafters that read hidden states (speculative/eagle.py).

A tree draft goes to the scheduler as its tokens flattened parents first; the scheduler plans it
back as a verify item [last, *tokens] (perhaps cut short: a prefix of the flattened nodes is
still a tree) and knows nothing of its shape. The runner kept the tree it proposed, recognizes the
item by its tokens, and has the attention layout (BatchLayout's trees) give node i RoPE position
start + depth(i), its K/V at slot position start + i, and sight of its ancestors only. Sampling
gives one row per node, its history the node's path; the walk from the root keeps the path the
target's own picks follow, and the accepted nodes' K/V move to slot positions start + depth, so
the request's KV is contiguous again before the scheduler shrinks it to what was accepted.
"""
from __future__ import annotations

from typing import Any

import torch

from services.worker.jump_forward import DraftRow
from services.worker.kv_pool import KVPool
from services.worker.speculative.tree import DraftTree, compaction_slots


def tree_of(item: Any, proposed: DraftTree | None) -> DraftTree | None:
    """The tree a verify item verifies: the request's proposed tree cut to the item's draft, when
    the item carries a prefix of its tokens and that prefix branches; None: a chain."""
    if proposed is None or not item.verify:
        return None
    draft = item.input_ids[1:]
    if not draft or draft != proposed.tokens[:len(draft)]:
        return None
    tree = proposed.truncated(len(draft))
    return None if tree.is_chain() else tree


def tree_rows(req: Any, tree: DraftTree) -> list[DraftRow]:
    """One sampler row per node (the root first): the request after the node's path."""
    return [DraftRow(req.prompt_ids, req.output_ids + tree.path(node), req.sampling, req.seed, None)
            for node in range(len(tree.tokens) + 1)]


def compact_accepted(pool: KVPool, pages: torch.Tensor, page_size: int, start: int, nodes: list[int]) -> None:
    """Move the accepted nodes' K/V (DraftTree.accept's nodes) from slot position start + node to
    start + depth through the request's pages [P] int64, so positions start .. start + len(nodes)
    hold the root and its accepted descendants."""
    src, dst = compaction_slots(pages, page_size, start, nodes)
    if src.numel():
        pool.move_slots(src, dst)
