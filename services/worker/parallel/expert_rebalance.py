"""EPLB at run time (--enable-eplb): every K forward passes, re-place the experts from the loads
recorded since the last placement, and move their weights between the ranks.

Every rank routes the whole batch, so every rank recorded the same loads (expert_load.py) and
computes the same new placement (expert_location.balanced); one small all-reduce checks that
they did. The rebalance runs before a forward pass, on every rank at the same pass (a forward
pre-hook; the ranks run the same passes), so it sits between two steps: no request is dropped or
retried. The weights move --eplb-rebalance-layers-per-chunk MoE layers at a time, those
layers computing with the old placement until all of their new weights are in place. Before
each pass, --eplb-rebalance-weights-per-pass expert weights leave in one async all_to_all_single
(on a process group of their own), cross while that pass computes, and land in staging buffers
before the next; then the chunk's layers switch. A step waits for packing and unpacking a few
expert weights, never for the whole move. Each new slot takes its expert from its own slot when it holds it already, else from
another slot of its rank, else from the lowest rank holding it: every rank computes the same
list of moves.
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

    @property
    def stays(self) -> bool:
        return self.src_rank == self.dst_rank and self.src_slot == self.dst_slot


@dataclass
class RebalanceStats:
    rebalances: int = 0  # completed
    last_seconds: float = 0.0  # the last one's moves, all chunks
    longest_pause_s: float = 0.0  # the longest one chunk held a step, over all rebalances
    moved_experts: int = 0  # expert weights this rank received from another, all rebalances
    last: dict | None = None  # the last planned rebalance's record (plan() returns it too)


@dataclass
class _Pending:
    """A planned rebalance whose layers have not all moved yet."""
    new: ExpertLocation
    rows: list[int]  # the MoE layers still to move
    record: dict
    chunk: Chunk | None = None  # the layers moving now


def plan_moves(old: ExpertLocation, new: ExpertLocation, rows: list[int]) -> list[Move]:
    """Where each slot of layers `rows` takes its new expert from (the same list on every rank)."""
    moves, slots = [], old.slots
    for row in rows:
        held = old.phy2log[row].tolist()
        for p, e in enumerate(new.phy2log[row].tolist()):
            dst = p // slots
            own = [q for q in range(dst * slots, (dst + 1) * slots) if held[q] == e]
            src = p if held[p] == e else own[0] if own else held.index(e)
            moves.append(Move(row, dst, p % slots, src // slots, src % slots))
    return moves


@dataclass
class Chunk:
    """The moves of a few layers: the weights that cross ranks leave a few per forward pass, and
    land in staging buffers; the layers switch once all have landed."""
    rows: list[int]
    moves: list[Move]
    posts: list[list[Move]]  # the crossing moves still to send, one group per pass
    landed: list[tuple[Move, torch.Tensor]] = field(default_factory=list)  # (move, its flat weights)
    in_flight: tuple[object, list[tuple[Move, torch.Tensor]]] | None = None  # (work, what it brings)


def make_chunk(rows: list[int], moves: list[Move], weights_per_pass: int) -> Chunk:
    crossing = [m for m in moves if m.src_rank != m.dst_rank]
    return Chunk(rows, moves, [crossing[i:i + weights_per_pass] for i in range(0, len(crossing), weights_per_pass)])


def post(params: dict[int, tuple[torch.Tensor, torch.Tensor]], crossing: list[Move], rank: int, size: int,
         group=None) -> tuple[object, list[tuple[Move, torch.Tensor]]]:
    """Send these cross-rank moves in one async all_to_all_single (every rank calls it with the same
    list; the weights are packed first, so the step that runs meanwhile may read them)."""
    any_pair = params[crossing[0].row]
    width = any_pair[0][0].numel() + any_pair[1][0].numel()  # one expert, flattened
    sends = [[m for m in crossing if m.src_rank == rank and m.dst_rank == d] for d in range(size)]
    recvs = [[m for m in crossing if m.dst_rank == rank and m.src_rank == s] for s in range(size)]
    outgoing = [_flat(params[m.row], m.src_slot) for per_dst in sends for m in per_dst]
    send_buf = torch.cat(outgoing) if outgoing else any_pair[0].new_empty(0)
    recv_buf = any_pair[0].new_empty(sum(len(r) for r in recvs) * width)
    work = dist.all_to_all_single(recv_buf, send_buf, [len(r) * width for r in recvs],
                                  [len(s) * width for s in sends], group=group, async_op=True)
    arrived = [m for per_src in recvs for m in per_src]
    return work, [(m, recv_buf[i * width:(i + 1) * width]) for i, m in enumerate(arrived)]


def apply_chunk(params: dict[int, tuple[torch.Tensor, torch.Tensor]], chunk: Chunk, rank: int) -> int:
    """Rewrite this rank's slots of the chunk's layers in place, once every weight has landed.
    Returns how many expert weights came from another rank."""
    local = [m for m in chunk.moves if m.dst_rank == rank and m.src_rank == rank and not m.stays]
    staged = [(m, params[m.row][0][m.src_slot].clone(), params[m.row][1][m.src_slot].clone()) for m in local]
    for m, gate_up, down in staged:  # read before any slot is written
        params[m.row][0][m.dst_slot].copy_(gate_up)
        params[m.row][1][m.dst_slot].copy_(down)
    for m, flat in chunk.landed:
        _unflat(params[m.row], m.dst_slot, flat)
    return len(chunk.landed)


def _flat(pair: tuple[torch.Tensor, torch.Tensor], slot: int) -> torch.Tensor:
    return torch.cat([pair[0][slot].flatten(), pair[1][slot].flatten()])


def _unflat(pair: tuple[torch.Tensor, torch.Tensor], slot: int, flat: torch.Tensor) -> None:
    gate_up, down = pair[0][slot], pair[1][slot]
    gate_up.copy_(flat[:gate_up.numel()].view_as(gate_up))
    down.copy_(flat[gate_up.numel():].view_as(down))


class ExpertRebalancer:
    """Plans a rebalance every `every` forward passes (None: only when asked) from the recorder's
    window, and moves it `layers_per_chunk` MoE layers at a time, `weights_per_pass` expert
    weights crossing ranks per forward pass."""

    def __init__(self, blocks: list, holder: LocationHolder, recorder: ExpertLoadRecorder, rank: int, size: int,
                 redundant: int, every: int | None, layers_per_chunk: int = 1, weights_per_pass: int = 2,
                 group=None) -> None:
        self.blocks, self.holder, self.recorder = blocks, holder, recorder
        self.rank, self.size, self.redundant, self.every, self.group = rank, size, redundant, every, group
        self.layers_per_chunk, self.weights_per_pass = layers_per_chunk, weights_per_pass
        self.forwards = 0
        self.stats = RebalanceStats()
        self._pending: _Pending | None = None

    def before_forward(self) -> None:
        self.forwards += 1
        if self._pending is None and self.every and self.forwards % self.every == 0:
            self.plan()
        elif self._pending is not None:
            self._advance()

    @property
    def moving(self) -> bool:
        return self._pending is not None

    def imbalance(self, location: ExpertLocation | None = None) -> float | None:
        """The window's mean over layers of (max over mean tokens per rank); None before any token."""
        loads = self.recorder.window.counts.cpu()
        if not int(loads.sum()):
            return None
        per_rank = (location or self.holder.location).rank_loads(loads)  # [layers, ep]
        mean = per_rank.mean(1).clamp(min=1e-9)
        return float((per_rank.max(1).values / mean)[per_rank.sum(1) > 0].mean())

    def plan(self) -> dict | None:
        """Plan a rebalance from the window's loads; its layers move on the next forward passes.
        Returns its record, or None when no token was recorded (or one is moving already)."""
        loads = self.recorder.window.counts.cpu()
        if self._pending is not None or not int(loads.sum()):
            return None
        began = time.perf_counter()
        old = self.holder.location
        new = ExpertLocation.balanced(loads, self.size, self.redundant)
        self._check_agreed(new)
        record = {"forward": self.forwards, "imbalance_before": self.imbalance(old),
                  "imbalance_expected": self.imbalance(new), "layers": len(old.changed_rows(new)), "moved": 0,
                  "seconds": 0.0, "longest_pause_s": 0.0, "pauses_ms": []}
        record["plan_ms"] = round((time.perf_counter() - began) * 1e3, 2)
        self.stats.last = record
        self._pending = _Pending(new, old.changed_rows(new), record)
        self._advance()  # the first chunk leaves now
        return record

    def _check_agreed(self, new: ExpertLocation) -> None:
        """Every rank must have planned the same placement (they recorded the same loads), or the
        weight moves would not match: one small all-reduce turns a disagreement into an error
        naming it instead of mismatched collectives."""
        plan = new.phy2log.flatten().to(torch.int64)  # [layers P]
        highest = plan.clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.group)
        lowest = plan.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.group)
        if not (torch.equal(highest, plan) and torch.equal(lowest, plan)):
            raise RuntimeError(f"rank {self.rank}: the expert-parallel ranks planned different placements (their "
                               "recorded expert loads differ: was a window reset on one rank only?)")

    def _params(self, rows: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {r: (self.blocks[r].experts.gate_up_proj.data, self.blocks[r].experts.down_proj.data) for r in rows}

    def _advance(self) -> None:
        """Before a forward pass: what crossed during the last pass lands; the next weights leave,
        to cross while this pass computes; a chunk whose weights all landed switches its layers."""
        began = time.perf_counter()
        pending = self._pending
        chunk = pending.chunk
        if chunk is not None and chunk.in_flight is not None:
            work, arriving = chunk.in_flight
            work.wait()
            chunk.landed += arriving
            chunk.in_flight = None
        if chunk is not None and not chunk.posts:
            pending.record["moved"] += apply_chunk(self._params(chunk.rows), chunk, self.rank)
            self.holder.location = self.holder.location.with_rows(pending.new, chunk.rows)
            pending.chunk = chunk = None
        if chunk is None and pending.rows:
            rows, pending.rows = pending.rows[:self.layers_per_chunk], pending.rows[self.layers_per_chunk:]
            chunk = pending.chunk = make_chunk(rows, plan_moves(self.holder.location, pending.new, rows),
                                               self.weights_per_pass)
        if chunk is not None and chunk.posts:
            chunk.in_flight = post(self._params(chunk.rows), chunk.posts.pop(0), self.rank, self.size, self.group)
        pause = time.perf_counter() - began
        pending.record["seconds"] += pause
        pending.record["longest_pause_s"] = max(pending.record["longest_pause_s"], pause)
        pending.record["pauses_ms"].append(round(pause * 1e3, 2))
        if pending.chunk is None and not pending.rows:
            self._finish()

    def _finish(self) -> None:
        record, s = self._pending.record, self.stats
        self._pending = None
        self.recorder.reset_window()  # the gauge measures the new placement from here
        s.rebalances += 1
        s.moved_experts += record["moved"]
        s.last_seconds = record["seconds"]
        s.longest_pause_s = max(s.longest_pause_s, record["longest_pause_s"])
        log.info("experts rebalanced", extra={"rank": self.rank, **{k: v for k, v in record.items()
                                                                   if isinstance(v, (int, float))}})
