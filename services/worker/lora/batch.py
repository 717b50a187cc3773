"""A step's token rows grouped by LoRA slot: computed once per step, read by every hooked linear.

The runner's flat batch is the step's items one after another, so each request's tokens are a
contiguous run of rows. A slot whose tokens form one run is addressed by a slice (its rows are a
view of the linear's input, and its delta adds in place); a slot spread over several runs by an
index tensor (a gather, and an index_add back).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Rows = slice | torch.Tensor  # a contiguous run of rows, or int64 row indices [n]


@dataclass(frozen=True)
class LoraBatch:
    groups: tuple[tuple[int, Rows], ...]  # (slot, its rows of the step's [T, ...] activations)


class LoraContext:
    """The batch the model's hooks apply now; None: no adapter in this step (hooks add nothing)."""

    batch: LoraBatch | None = None


def group_rows(spans: list[tuple[int, int]], device: torch.device) -> LoraBatch | None:
    """spans: per item in flat order, (slot or -1 for the base model, its token count)
    → the rows of each slot (merged runs), or None when every item runs on the base model."""
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for slot, n in spans:
        if slot >= 0 and n > 0:
            mine = runs.setdefault(slot, [])
            if mine and mine[-1][1] == start:
                mine[-1] = (mine[-1][0], start + n)
            else:
                mine.append((start, start + n))
        start += n
    if not runs:
        return None
    groups = []
    for slot, ranges in runs.items():
        if len(ranges) == 1:
            rows: Rows = slice(*ranges[0])
        else:
            rows = torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in ranges]).to(device)
        groups.append((slot, rows))
    return LoraBatch(tuple(groups))
