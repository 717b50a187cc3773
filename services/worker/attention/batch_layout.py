"""The flat token layout of one step, derived once from the plan's items.

An item may be a draft tree (speculative/tree.py): its tokens still take consecutive KV slots,
but each token's RoPE position is its depth in the tree, and the attention backend masks it to
its ancestors (the layout carries the trees for that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.speculative.tree import DraftTree


@dataclass
class BatchLayout:
    """A step's tokens are the items' input_ids concatenated (T tokens, B items).

    Item i owns tokens [cu_q[i], cu_q[i+1]) at positions start_pos[i] + 0.. and
    its KV (after this step's write) spans positions [0, kv_lens[i]). A tree item (in `trees`)
    writes token j to the slot of position start + j as any item does, but its RoPE position
    (`positions`) is start + depth(j), and token j attends only to positions < start and to the
    item's tokens that are its ancestors or itself.
    """

    q_lens: torch.Tensor  # [B] int64
    start_pos: torch.Tensor  # [B] int64, tokens already in KV before this step
    kv_lens: torch.Tensor  # [B] int64 == start_pos + q_lens
    page_rows: torch.Tensor  # [B, max_pages] int64, each item's page table (padded)
    page_size: int
    positions: torch.Tensor  # [T] int64
    token_item: torch.Tensor  # [T] int64, the item each token belongs to
    out_slots: torch.Tensor  # [T] int64, KV slots this step writes
    max_q_len: int
    max_kv_len: int
    # On a device: the host layout it was copied from, for a backend that plans on the host
    # (FlashInfer) without copying back (a sync behind everything queued). None on the host.
    host: "BatchLayout | None" = None
    trees: "dict[int, DraftTree] | None" = None  # item index → the tree its q_len = n + 1 tokens form

    @classmethod
    def build(cls, q_lens: list[int], start_pos: list[int], page_rows: torch.Tensor, page_size: int,
              trees: "dict[int, DraftTree] | None" = None) -> "BatchLayout":
        ql = torch.tensor(q_lens, dtype=torch.int64)
        sp = torch.tensor(start_pos, dtype=torch.int64)
        T = int(ql.sum())
        token_item = torch.repeat_interleave(torch.arange(len(q_lens)), ql, output_size=T)
        offsets = torch.cumsum(ql, 0) - ql  # [B] first token index of each item
        positions = sp[token_item] + (torch.arange(T) - offsets[token_item])
        out_slots = slots_of(page_rows, token_item, positions, page_size)
        kv = sp + ql
        if trees:
            positions = _tree_positions(positions, q_lens, start_pos, trees)
        return cls(ql, sp, kv, page_rows, page_size, positions, token_item, out_slots,
                   max(q_lens), int(kv.max()), trees=trees or None)

    def to(self, device: torch.device) -> "BatchLayout":
        """This layout with its tensors on `device` (one pinned non-blocking copy on CUDA;
        itself on the CPU), built on the host from the host page table."""
        if device.type == "cpu":
            return self
        from services.worker.host_to_device import to_device
        ql, sp, kv, rows, pos, item, slots = to_device(
            [self.q_lens, self.start_pos, self.kv_lens, self.page_rows, self.positions, self.token_item,
             self.out_slots], device)
        return BatchLayout(ql, sp, kv, rows, self.page_size, pos, item, slots, self.max_q_len, self.max_kv_len,
                           host=self, trees=self.trees)

    @property
    def all_decode(self) -> bool:
        return self.max_q_len == 1


def _tree_positions(slot_positions: torch.Tensor, q_lens: list[int], start_pos: list[int],
                    trees: "dict[int, DraftTree]") -> torch.Tensor:
    """[T] RoPE positions: the slot positions, with each tree item's tokens at start + depth."""
    positions = slot_positions.clone()
    first = [0]
    for q in q_lens:
        first.append(first[-1] + q)
    for i, tree in trees.items():
        if q_lens[i] != tree.n + 1:
            raise ValueError(f"item {i} has {q_lens[i]} tokens but its draft tree {tree.n + 1} nodes "
                             "(the root and each draft token)")
        positions[first[i]:first[i + 1]] = start_pos[i] + torch.tensor(tree.depths(), dtype=torch.int64)
    return positions


def slots_of(page_rows: torch.Tensor, item: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV slot of (item, position) pairs through the page table; any shape."""
    pages = page_rows[item, pos // page_size]
    return pages * page_size + pos % page_size
