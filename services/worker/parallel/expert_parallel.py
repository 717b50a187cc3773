"""Expert parallelism (--ep-size): a sparse block's experts split over the ranks of the group,
tokens sent to the ranks that own their experts and the results sent back, by all-to-all.

The group's attention is tensor-parallel, so every rank enters a MoE layer with the whole
batch's hidden states. Every rank routes the whole batch (the router is small and replicated):
so every rank knows, without asking, which rows every other rank will send it. Then each rank
takes its share of the tokens (rank r: the r-th contiguous slice) and:

1. dispatch: sends each (token, choice) row to the rank owning its physical expert
   (expert_location.py picks the replica), one all_to_all_single over the group;
2. computes the rows it received, grouped by its expert slots (GroupedExperts.run_sorted);
3. combine: sends each result back to the rank that owns its token (a second all_to_all_single);
4. weights the rows and sums each token's choices in ascending expert order (as the one-process
   block does), into its slice of a zero [T, hidden] output.

The MLP block's all-reduce (tensor_parallel.py) then sums the slices: every rank leaves with the
whole output. Collectives: torch.distributed's (gloo on CPU, NCCL on CUDA), bounded by the group's
timeout like every other.

Two-batch overlap (--enable-two-batch-overlap): each rank's slice is split into two micro-batches;
both dispatches start at once (async), then each micro-batch is computed as soon as its rows
arrived and its combine started, so one's communication runs while the other computes.
`CommTimes` keeps what the waits cost, for bench/moe.py's hidden share.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.worker.model.layer_ops import LayerOps
from services.worker.model.moe import GroupedExperts
from services.worker.parallel.expert_location import ExpertLocation, pick_physical


@dataclass
class CommTimes:
    """Seconds spent waiting for the all-to-alls (exposed), and in the whole MoE dispatch."""
    waiting_s: float = 0.0
    total_s: float = 0.0
    calls: int = 0


class LocationHolder:
    """The group's current placement, shared by every layer's dispatch (a rebalance swaps it)."""

    def __init__(self, location: ExpertLocation) -> None:
        self.location = location


def token_range(tokens: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of `tokens` rows (the first ranks take one more)."""
    base, extra = divmod(tokens, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass
class _MicroBatch:
    """One micro-batch's exchange, as this rank sees it."""
    start: int  # its first token (this rank's)
    send_order: torch.Tensor  # [n_send]: this rank's flat rows (token - start) · k + choice, by physical slot
    send_counts: list[int]  # rows to each rank
    recv_counts: list[int]  # rows from each rank
    recv_slots: torch.Tensor  # [n_recv]: the local slot of each row received, in arrival order
    received: torch.Tensor | None = None
    results: torch.Tensor | None = None
    returned: torch.Tensor | None = None
    work: object = None


class ExpertParallel:
    """A sparse block's dispatch (moe.ExpertDispatch) on rank `rank` of an `size`-rank group."""

    def __init__(self, rank: int, size: int, holder: LocationHolder, row: int, two_batch: bool = False,
                 times: CommTimes | None = None, group=None) -> None:
        self.rank, self.size, self.holder, self.row = rank, size, holder, row
        self.two_batch, self.group = two_batch, group
        self.times = times or CommTimes()

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, grouped: GroupedExperts,
                 ops: LayerOps) -> torch.Tensor:
        began = time.perf_counter()
        location = self.holder.location
        physical = pick_physical(location, self.row, experts)  # [T, k]
        out = torch.zeros_like(x)
        batches = [self._plan(physical, ranges, location.slots) for ranges in self._ranges(x.shape[0])]
        for mb in batches:  # every dispatch in flight at once
            mb.received = x.new_empty(sum(mb.recv_counts), x.shape[1])
            rows = x[mb.start:].index_select(0, mb.send_order // experts.shape[1])
            mb.work = self._all_to_all(mb.received, rows, mb.recv_counts, mb.send_counts)
        for mb in batches:
            self._wait(mb)
            mb.results = _compute(grouped, mb.received, mb.recv_slots, location.slots, ops)
            mb.returned = x.new_empty(mb.send_order.numel(), x.shape[1])
            mb.work = self._all_to_all(mb.returned, mb.results, mb.send_counts, mb.recv_counts)
        for mb in batches:
            self._wait(mb)
            _accumulate(out, mb, experts, weights)
        self.times.total_s += time.perf_counter() - began
        self.times.calls += 1
        return out

    def _ranges(self, tokens: int) -> list[list[tuple[int, int]]]:
        """Per micro-batch, every rank's token range."""
        shares = [token_range(tokens, r, self.size) for r in range(self.size)]
        if not self.two_batch:
            return [shares]
        halves = [((a, (a + b) // 2), ((a + b) // 2, b)) for a, b in shares]
        return [[h[0] for h in halves], [h[1] for h in halves]]

    def _plan(self, physical: torch.Tensor, ranges: list[tuple[int, int]], slots: int) -> _MicroBatch:
        a, b = ranges[self.rank]
        mine = physical[a:b].flatten()  # [n_send]
        send_order = torch.argsort(mine, stable=True)
        send_counts = torch.bincount(mine // slots, minlength=self.size).tolist()
        recv_slots, recv_counts = [], []
        for src_a, src_b in ranges:
            theirs = physical[src_a:src_b].flatten()
            to_me = torch.sort(theirs[theirs // slots == self.rank], stable=True).values - self.rank * slots
            recv_slots.append(to_me)
            recv_counts.append(to_me.numel())
        return _MicroBatch(a, send_order, send_counts, recv_counts, torch.cat(recv_slots))

    def _all_to_all(self, output: torch.Tensor, rows: torch.Tensor, out_counts: list[int], in_counts: list[int]):
        return dist.all_to_all_single(output, rows.contiguous(), out_counts, in_counts, group=self.group, async_op=True)

    def _wait(self, mb: _MicroBatch) -> None:
        began = time.perf_counter()
        mb.work.wait()
        self.times.waiting_s += time.perf_counter() - began


def _compute(grouped: GroupedExperts, received: torch.Tensor, slots_of_rows: torch.Tensor, slots: int,
             ops: LayerOps) -> torch.Tensor:
    """The rows this rank received [n, hidden] → their experts' outputs, in arrival order."""
    order = torch.argsort(slots_of_rows, stable=True)
    counts = torch.bincount(slots_of_rows, minlength=slots).tolist()
    results = torch.empty_like(received)
    results[order] = grouped.run_sorted(received.index_select(0, order), counts, ops)
    return results


def _accumulate(out: torch.Tensor, mb: _MicroBatch, experts: torch.Tensor, weights: torch.Tensor) -> None:
    """Weight the rows that came back and add each token's in ascending logical-expert order."""
    k = experts.shape[1]
    flat_rows = mb.send_order  # returned[i] is this rank's flat row flat_rows[i]
    logical = experts[mb.start:].flatten().index_select(0, flat_rows)
    rows = mb.returned * weights[mb.start:].flatten().index_select(0, flat_rows).unsqueeze(1)
    by_expert = torch.argsort(logical, stable=True)
    tokens = mb.start + flat_rows.index_select(0, by_expert) // k
    out.index_add_(0, tokens, rows.index_select(0, by_expert))
