"""A step's token rows grouped by LoRA slot: computed once per step, read by every hooked linear.

The runner's flat batch is the step's items one after another, so each request's tokens are a
contiguous run of rows. A slot whose tokens form one run is addressed by a slice (its rows are a
view of the linear's input, and its delta adds in place); a slot spread over several runs by an
index tensor (a gather, and an index_add back).

With several slots in a step, per-slot matmuls cost a few small ops each per linear: 8 adapters
make ~4,000 ops a step over SmolLM2's 120 linears. `Padded` lays the step's adapter rows out as
[G, L] (G slots, L the largest slot's rows, short slots padded with a repeated row) so each
linear applies every slot with one gather, two batched matmuls and one index_add (an SGMV on
CPU). It is used when the padding wastes little (G * L <= 1.5 x the rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Rows = slice | torch.Tensor  # a contiguous run of rows, or int64 row indices [n]


@dataclass(frozen=True)
class Padded:
    """Every adapter row of a step as [G, L]: gather [G * L] row indices (padding repeats a row),
    keep [n] the positions in G * L that are real rows, rows [n] those rows (scatter targets),
    slots [G] int64 the slot of each group, all_slots: slots == 0..G-1 (the stacks as they are)."""
    gather: torch.Tensor
    keep: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    length: int
    all_slots: bool


@dataclass(frozen=True)
class LoraBatch:
    groups: tuple[tuple[int, Rows], ...]  # (slot, its rows of the step's [T, ...] activations)
    padded: Padded | None = None  # the same rows laid out for one batched matmul (several slots)
    # The same rows for the fused kernel (kernels/lora_cpu.py): order int32 [n] the adapter rows
    # grouped by slot, slot_groups int32 [G, 3] (slot, begin, end) into order.
    order: torch.Tensor | None = None
    slot_groups: torch.Tensor | None = None


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
    return LoraBatch(tuple(groups), _padded(runs, device), *_kernel_rows(runs, device))


def _kernel_rows(runs: dict[int, list[tuple[int, int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """→ order int32 [n] (every adapter row, grouped by slot), slot_groups int32 [G, 3]."""
    order: list[int] = []
    slot_groups: list[list[int]] = []
    for slot, ranges in runs.items():
        begin = len(order)
        for lo, hi in ranges:
            order += range(lo, hi)
        slot_groups.append([slot, begin, len(order)])
    return (torch.tensor(order, dtype=torch.int32, device=device),
            torch.tensor(slot_groups, dtype=torch.int32, device=device))


def _padded(runs: dict[int, list[tuple[int, int]]], device: torch.device) -> Padded | None:
    """The [G, L] layout of several slots' rows, or None for one slot or when padding would waste
    more than half the rows again."""
    if len(runs) < 2:
        return None
    slots = sorted(runs)
    members = [[r for lo, hi in runs[s] for r in range(lo, hi)] for s in slots]
    n, length = sum(map(len, members)), max(map(len, members))
    if len(slots) * length > 1.5 * n:
        return None
    gather, keep = [], []
    for g, rows in enumerate(members):
        gather += rows + [rows[0]] * (length - len(rows))
        keep += range(g * length, g * length + len(rows))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return Padded(as_tensor(gather), as_tensor(keep), as_tensor([r for rows in members for r in rows]),
                  as_tensor(slots), length, slots == list(range(len(slots))))
