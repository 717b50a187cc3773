"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step of a small model on a GPU is launch-bound: ~600 kernels of microseconds each,
issued one by one from Python. Captured once per bucket, a step becomes one replay. The step's
inputs live in static device buffers that the graph reads; each replay first copies the step's
values into them (one packed host→device copy, host_to_device.py).

A step of B requests runs in the smallest bucket >= B (1, 2, 4, 8, then multiples of 8 up to
--cuda-graph-max-bs). The padding rows decode token 0 at position 0 of a scratch page: the pool
holds one page beyond the pages the scheduler hands out (KVPool's extra_pages), so their K/V
writes never touch a request's. Their logits are dropped.

What must hold for a captured step to equal an eager one: the backend's capture-time preparation
(prepare_graph_decode) derives everything from the static buffers with device ops only (no host
sync, no shape that depends on their values), and the split-K count is pinned for the bucket
at the longest context the page table can hold. A speculative or jump-forward verify item
rides the same graphs: its positions are rows sharing one page-table row, each attending
through its own position (the backend writes every row's K/V before any row attends), so the
verify width needs no graphs of its own. Steps with LoRA adapters or prefill chunks run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from services.worker.attention.batch_layout import BatchLayout
from services.worker.config import WorkerConfig
from services.worker.host_to_device import to_device
from services.worker.kv_pool import KVPool, KVPoolSpec

log = logging.getLogger(__name__)


class GraphRunner(Protocol):
    """What the graphs read of the runner whose decode steps they capture (ModelRunner is one).
    Named here because the runner builds the graphs: this module never imports it."""

    config: WorkerConfig  # max_requests bounds the buckets
    device: torch.device
    page_table: torch.Tensor  # [N, P] int64: the static inputs hold P pages a row
    kv_spec: KVPoolSpec
    pool: KVPool
    backend: Any  # one with prepare_graph_decode(layout, pool): the triton backend
    model: torch.nn.Module  # (token_ids, meta, sampled) → logits

    def forward_meta(self, positions: torch.Tensor) -> Any:
        """What the model's layers see of a step: positions and the backend's attention."""


def graph_buckets(max_bs: int) -> list[int]:
    """The batch sizes captured: powers of two to 8, then every multiple of 8, up to max_bs
    (max_bs itself included)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows, None when n exceeds them all (or n is 0)."""
    if n < 1:
        return None
    return next((b for b in buckets if b >= n), None)


@dataclass
class DecodeInputs:
    """One step's inputs padded to a bucket, on the host: int64 [bs] each, page_rows [bs, P]."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    page_rows: torch.Tensor
    out_slots: torch.Tensor


def pad_decode_inputs(token_ids: list[int], positions: list[int], rows: list[int], page_table: torch.Tensor,
                      page_size: int, bs: int, scratch_page: int) -> DecodeInputs:
    """The host tensors of a decode step of len(token_ids) <= bs rows (row i: token_ids[i] at
    positions[i] of page-table row rows[i]), padded to bs rows that decode token 0 at position 0
    of scratch_page."""
    n = len(token_ids)
    if not 0 < n <= bs:
        raise ValueError(f"a decode step of {n} rows does not fit a bucket of {bs}")
    pad = bs - n
    page_rows = torch.full((bs, page_table.shape[1]), scratch_page, dtype=torch.int64)
    page_rows[:n] = page_table[torch.tensor(rows, dtype=torch.int64)]
    pos = torch.tensor(positions + [0] * pad, dtype=torch.int64)
    pages = page_rows[torch.arange(bs), pos // page_size]
    return DecodeInputs(torch.tensor(token_ids + [0] * pad, dtype=torch.int64), pos, page_rows,
                        pages * page_size + pos % page_size)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: DecodeInputs  # the static device buffers the graph reads
    logits: torch.Tensor  # [bs, V], what the graph writes (the eager forward's dtype)


class DecodeGraphs:
    """Capture every bucket's decode step for `runner` (its model, backend and pool on CUDA),
    then replay: run() → logits, or None for a step no bucket holds."""

    def __init__(self, runner: GraphRunner, max_bs: int, scratch_page: int):
        self.runner, self.scratch_page = runner, scratch_page
        self.buckets = graph_buckets(min(max_bs, runner.config.max_requests))
        self.max_pages = runner.page_table.shape[1]
        self.graphs: dict[int, _Captured] = {}

    def capture(self) -> float:
        """Capture each bucket, largest first (they share one memory pool) → seconds taken."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            self.graphs[bs] = self._capture_one(bs, pool)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s", len(self.graphs), self.buckets, seconds)
        return seconds

    def _capture_one(self, bs: int, pool) -> _Captured:
        device = self.runner.device
        page_size = self.runner.kv_spec.page_size
        host = pad_decode_inputs([0], [0], [0], torch.full((1, self.max_pages), self.scratch_page), page_size, bs,
                                 self.scratch_page)
        static = DecodeInputs(*(t.to(device) for t in (host.token_ids, host.positions, host.page_rows,
                                                        host.out_slots)))
        every = torch.arange(bs, device=device)
        forward = self._forward(static, every, bs)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: autotuning and lazy allocations outside the capture
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return _Captured(graph, static, logits)

    def _forward(self, static: DecodeInputs, every: torch.Tensor, bs: int):
        """The captured work: the backend's capture-safe preparation, then the model."""
        runner = self.runner
        ones = torch.ones(bs, dtype=torch.int64, device=static.positions.device)
        max_kv = self.max_pages * runner.kv_spec.page_size

        def forward() -> torch.Tensor:
            layout = BatchLayout(ones, static.positions, static.positions + 1, static.page_rows,
                                 runner.kv_spec.page_size, static.positions, every, static.out_slots, 1, max_kv)
            runner.backend.prepare_graph_decode(layout, runner.pool)
            meta = runner.forward_meta(static.positions)
            return runner.model(static.token_ids, meta, every)
        return forward

    def run(self, token_ids: list[int], positions: list[int], rows: list[int],
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """A decode step's logits [len(token_ids), V] from its bucket's replay; None when
        no bucket holds it (the caller runs it eagerly). fill(token_ids [bs]): rewrites inputs
        on the device before the replay (LAST_SAMPLED tokens still on the device)."""
        bs = bucket_for(len(token_ids), self.buckets)
        if bs is None:
            return None
        captured = self.graphs[bs]
        host = pad_decode_inputs(token_ids, positions, rows, self.runner.page_table[:, :self.max_pages],
                                 self.runner.kv_spec.page_size, bs, self.scratch_page)
        moved = to_device([host.token_ids, host.positions, host.page_rows, host.out_slots], self.runner.device)
        for dst, src in zip((captured.inputs.token_ids, captured.inputs.positions, captured.inputs.page_rows,
                             captured.inputs.out_slots), moved):
            dst.copy_(src, non_blocking=True)
        if fill is not None:
            fill(captured.inputs.token_ids)
        captured.graph.replay()
        return captured.logits[:len(token_ids)]
