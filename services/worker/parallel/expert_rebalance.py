"""EPLB at run time (--enable-eplb): every K forward passes, re-place the experts from the loads
recorded since the last placement, and move their weights between the ranks.

Every rank routes the whole batch, so every rank recorded the same loads (expert_load.py) and
computes the same new placement (expert_location.balanced): no collective is needed to agree on
it. The rebalance runs before a forward pass, on every rank at the same pass (a forward
pre-hook; the ranks run the same passes), so it sits between two steps: no request is dropped or
retried, and the one step it precedes waits for it. The weights move in one all_to_all_single:
each new slot takes its expert from a slot of its own rank that holds it, else from the lowest
rank holding it, every rank computing the same list of moves.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from services.worker.model.expert_load import ExpertLoadRecorder
from services.worker.parallel.expert_location import ExpertLocation
from services.worker.parallel.expert_parallel import LocationHolder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    row: int  # the MoE layer (recorder row)
    dst_rank: int
    dst_slot: int
    src_rank: int
    src_slot: int


@dataclass
class RebalanceStats:
    rebalances: int = 0
    last_seconds: float = 0.0
    moved_experts: int = 0  # expert weights that crossed between ranks, all rebalances
    history: list[dict] = field(default_factory=list)  # imbalance before / after each


def plan_moves(old: ExpertLocation, new: ExpertLocation) -> list[Move]:
    """Where each slot's new expert comes from: its own rank when that rank holds it, else the
    lowest rank holding it (the same list on every rank)."""
    moves = []
    slots = old.slots
    for row in range(new.phy2log.shape[0]):
        held = old.phy2log[row].tolist()
        for p, e in enumerate(new.phy2log[row].tolist()):
            dst = p // slots
            mine = [q for q in range(dst * slots, (dst + 1) * slots) if held[q] == e]
            src = mine[0] if mine else held.index(e)
            moves.append(Move(row, dst, p % slots, src // slots, src % slots))
    return moves


def move_weights(params: list[tuple[torch.Tensor, torch.Tensor]], moves: list[Move], rank: int, size: int,
                 group=None) -> int:
    """params[row] = (gate_up [S, 2I, H], down [S, H, I]) of this rank, rewritten in place to the
    new placement. Returns how many expert weights this rank received from another rank."""
    width = params[0][0][0].numel() + params[0][1][0].numel()  # one expert, flattened
    sends = [[m for m in moves if m.src_rank == rank and m.dst_rank == d] for d in range(size)]
    recvs = [[m for m in moves if m.dst_rank == rank and m.src_rank == s] for s in range(size)]
    for d in range(size):
        if d == rank:
            sends[d], recvs[d] = [], []
    outgoing = [_flat(params[m.row], m.src_slot) for d in range(size) for m in sends[d]]
    send_buf = torch.cat(outgoing) if outgoing else params[0][0].new_empty(0)
    recv_buf = params[0][0].new_empty(sum(len(r) for r in recvs) * width)
    dist.all_to_all_single(recv_buf, send_buf, [len(r) * width for r in recvs], [len(s) * width for s in sends],
                           group=group)
    local = [m for m in moves if m.dst_rank == rank and m.src_rank == rank]
    new = [(gu.clone(), down.clone()) for gu, down in params]
    for m in local:
        new[m.row][0][m.dst_slot].copy_(params[m.row][0][m.src_slot])
        new[m.row][1][m.dst_slot].copy_(params[m.row][1][m.src_slot])
    received = [m for s in range(size) for m in recvs[s]]
    for i, m in enumerate(received):
        _unflat(new[m.row], m.dst_slot, recv_buf[i * width:(i + 1) * width])
    with torch.no_grad():
        for (gu, down), (new_gu, new_down) in zip(params, new):
            gu.copy_(new_gu)
            down.copy_(new_down)
    return len(received)


def _flat(pair: tuple[torch.Tensor, torch.Tensor], slot: int) -> torch.Tensor:
    return torch.cat([pair[0][slot].flatten(), pair[1][slot].flatten()])


def _unflat(pair: tuple[torch.Tensor, torch.Tensor], slot: int, flat: torch.Tensor) -> None:
    gate_up, down = pair[0][slot], pair[1][slot]
    gate_up.copy_(flat[:gate_up.numel()].view_as(gate_up))
    down.copy_(flat[gate_up.numel():].view_as(down))


class ExpertRebalancer:
    """Rebalances every `every` forward passes (None: only when asked) from the recorder's window."""

    def __init__(self, blocks: list, holder: LocationHolder, recorder: ExpertLoadRecorder, rank: int, size: int,
                 redundant: int, every: int | None, group=None) -> None:
        self.blocks, self.holder, self.recorder = blocks, holder, recorder
        self.rank, self.size, self.redundant, self.every, self.group = rank, size, redundant, every, group
        self.forwards = 0
        self.stats = RebalanceStats()

    def before_forward(self) -> None:
        self.forwards += 1
        if self.every and self.forwards % self.every == 0:
            self.rebalance()

    def imbalance(self, location: ExpertLocation | None = None) -> float | None:
        """The window's mean over layers of (max over mean tokens per rank); None before any token."""
        loads = self.recorder.window.counts.cpu()
        if not int(loads.sum()):
            return None
        per_rank = (location or self.holder.location).rank_loads(loads)  # [layers, ep]
        mean = per_rank.mean(1).clamp(min=1e-9)
        return float((per_rank.max(1).values / mean)[per_rank.sum(1) > 0].mean())

    def rebalance(self) -> bool:
        """Re-place from the window's loads; False when there were none (nothing changes)."""
        loads = self.recorder.window.counts.cpu()
        if not int(loads.sum()):
            return False
        began = time.perf_counter()
        old = self.holder.location
        new = ExpertLocation.balanced(loads, self.size, self.redundant)
        before, after = self.imbalance(old), self.imbalance(new)
        moved = 0
        if not new.same_as(old):
            params = [(b.experts.gate_up_proj.data, b.experts.down_proj.data) for b in self.blocks]
            moved = move_weights(params, plan_moves(old, new), self.rank, self.size, self.group)
            self.holder.location = new
        self.recorder.reset_window()
        s = self.stats
        s.rebalances += 1
        s.moved_experts += moved
        s.last_seconds = time.perf_counter() - began
        s.history.append({"forward": self.forwards, "imbalance_before": before, "imbalance_expected": after,
                          "seconds": s.last_seconds, "moved": moved})
        log.info("experts rebalanced", extra={"rank": self.rank, "imbalance_before": before,
                                              "imbalance_expected": after, "seconds": round(s.last_seconds, 4)})
        return True
