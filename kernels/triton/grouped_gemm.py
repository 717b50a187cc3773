"""A grouped GEMM on the GPU: each group of rows times its own weight, every group in one launch
(a mixture-of-experts layer's experts over the rows routed to each), and its torch reference.

grouped_gemm(rows, offsets, weight): rows [N, K] sorted by group, group s owning rows
offsets[s] .. offsets[s+1] (offsets [S + 1], 0 first and N last); weight [S, M, K], one nn.Linear
weight per group → out [N, M], out[group s's rows] = rows[those] @ weight[s].T. float32 sums, one
rounding into rows' dtype (float32/bfloat16/float16).

One launch, whatever the groups' sizes: the grid's first axis is a flattened list of row tiles,
group s's rows cut into ceil(n_s / BLOCK_N) tiles of its own, in group order; the second axis is
the output columns in BLOCK_M tiles. The sizes live on the device (a caller builds offsets there
with a cumsum), so the grid is sized for the most tiles S groups of N rows can take,
min(ceil(N / BLOCK_N) + S, N), and a program past the last tile exits. A program finds its group
from offsets in a few vector ops (tiles per group, their running sum, the count of groups ending at
or before its tile): no host read, no loop over the groups. Empty groups take no tile. No tile
mixes two groups, so each program reads one group's weight tile.

On a CUDA device the values of offsets are trusted (checking them would cost a device sync); on
CPU tensors (the interpreter) they are checked. The reference, grouped_gemm_reference, is the torch
loop over the groups in float32. Triton is imported on first use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OFFSET_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings (num_warps/num_stages matter only on a GPU)."""

    block_n: int  # rows of one group per tile
    block_m: int  # output columns per tile
    block_k: int  # input features per step
    num_warps: int
    num_stages: int


def block_config(n: int, groups: int) -> BlockConfig:
    """Tiles by the mean rows per group. Decode (a few rows per expert) is bound by the weights'
    bytes: 16-row tiles (tl.dot's smallest) waste the least on each group's last, partial tile.
    Prefill is bound by math: taller and wider tiles reuse each loaded weight element more."""
    per_group = n / max(groups, 1)
    if per_group <= 16:
        return BlockConfig(16, 64, 128, 4, 4)
    if per_group <= 64:
        return BlockConfig(32, 64, 64, 4, 3)
    return BlockConfig(64, 128, 64, 8, 3)


def grouped_gemm(rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [N, K]: rows sorted by group; offsets [S + 1] int (group s owns rows offsets[s]..offsets[s+1]);
    weight [S, M, K] (nn.Linear layout per group) → [N, M] = rows[group s] @ weight[s].T for every s.

    rows float32/bfloat16/float16 (rows may be strided, the last dim contiguous), weight of rows'
    dtype and contiguous, offsets int32/int64 contiguous with offsets[0] = 0, offsets[S] = N and
    never decreasing, all on one CUDA device (CPU tensors only under TRITON_INTERPRET=1). Returns a
    new tensor in rows' dtype; float32 sums. Raises ValueError on a bad shape, stride, dtype,
    device or (CPU tensors) offset; RuntimeError without triton."""
    triton = _triton()
    _check(rows, offsets, weight)
    if not rows.is_cuda and not (rows.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"rows is on {rows.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if rows.device.type == "cpu":
        _check_offsets(rows, offsets)
    (n, k), (s, m) = rows.shape, weight.shape[:2]
    out = torch.empty(n, m, dtype=rows.dtype, device=rows.device)  # [N, M]
    if n == 0 or m == 0:
        return out
    if k == 0:  # an empty sum
        return out.zero_()
    interpret = bool(triton.knobs.runtime.interpret)
    # triton 3.9's interpreter multiplies bfloat16 blocks as their int16 bits (lora_sgmv.py): there
    # both sides go to float32 first (exact products, the same float32 sums); on a GPU they stay.
    upcast = interpret and rows.dtype == torch.bfloat16
    precision = "ieee" if rows.dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for half inputs
    cfg = block_config(n, s)
    tiles = min(triton.cdiv(n, cfg.block_n) + s, n)  # every tile holds a row: never more than N
    grid = (tiles, triton.cdiv(m, cfg.block_m))
    _kernel(interpret)[grid](
        rows, rows.stride(0), offsets, weight, out, s, m, k, S_PAD=max(16, triton.next_power_of_2(s)),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PRECISION=precision, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_reference(rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same contract as a torch loop over the groups, float32 products and sums on any device:
    the numbers the kernel must match within its float32 rounding."""
    _check(rows, offsets, weight)
    _check_offsets(rows, offsets)
    out = torch.zeros(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)  # [N, M]
    bounds = offsets.tolist()
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi > lo:
            out[lo:hi] = (rows[lo:hi].float() @ weight[s].float().t()).to(rows.dtype)  # [n_s, M]
    return out


def _check(rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> None:
    """Shapes, strides, dtypes and devices, as ValueErrors a caller can act on (no device sync)."""
    if rows.dim() != 2 or rows.dtype not in DTYPES:
        raise ValueError(f"rows must be [N, K] float32/bfloat16/float16, got {list(rows.shape)} {rows.dtype}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"rows needs a contiguous last dim, got strides {rows.stride()}")
    if weight.dim() != 3 or weight.shape[2] != rows.shape[1]:
        raise ValueError(f"weight must be [S, M, K = {rows.shape[1]}], got {list(weight.shape)}")
    if weight.dtype != rows.dtype:
        raise ValueError(f"weight ({weight.dtype}) must have rows' dtype {rows.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != weight.shape[0] + 1 or offsets.dtype not in OFFSET_DTYPES:
        raise ValueError(f"offsets must be int32/int64 [S + 1 = {weight.shape[0] + 1}], "
                         f"got {list(offsets.shape)} {offsets.dtype}")
    for name, t in (("weight", weight), ("offsets", offsets)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device}, rows on {rows.device}: move it first")


def _check_offsets(rows: torch.Tensor, offsets: torch.Tensor) -> None:
    """The offsets' values (on a GPU this would cost a sync per call): every row in one group."""
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != rows.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"offsets must start at 0, end at N = {rows.shape[0]} and never decrease, got {bounds}")


def _triton() -> Any:
    return import_triton("grouped GEMM", "grouped_gemm_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _source)[0]


def _source(tl: Any) -> Any:
    def grouped_gemm(rows_ptr, rows_stride, offsets_ptr, w_ptr, out_ptr, S, M, K, S_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr):
        """out[r, cols] = rows[r] @ w[group, cols].T for one group's BLOCK_N-row tile x BLOCK_M columns."""
        # Row tile program_id(0) → its group: group g's rows take ceil(n_g / BLOCK_N) tiles, in group
        # order, so the tile's group is the number of groups whose tiles end at or before it; S or
        # more: past the last tile. Reductions spelt tl.reduce / tl.associative_scan with
        # tl.standard's combine: tl.sum / tl.cumsum are jitted helpers the interpreter does not
        # resolve when tl is a closure (sampling.py).
        tile = tl.program_id(0)
        g = tl.arange(0, S_PAD)  # [S_PAD]
        lo = tl.load(offsets_ptr + g, mask=g < S, other=0).to(tl.int32)
        hi = tl.load(offsets_ptr + g + 1, mask=g < S, other=0).to(tl.int32)
        count = (hi - lo + BLOCK_N - 1) // BLOCK_N  # [S_PAD] tiles per group: 0 for an empty one
        ends = tl.associative_scan(count, 0, tl.standard._sum_combine)  # [S_PAD] running tile count
        group = tl.reduce((ends <= tile).to(tl.int32), 0, tl.standard._sum_combine)
        if group < S:
            mine = g == group
            start = tl.reduce(tl.where(mine, lo + (tile - ends + count) * BLOCK_N, 0), 0, tl.standard._sum_combine)
            stop = tl.reduce(tl.where(mine, hi, 0), 0, tl.standard._sum_combine)
            r = start + tl.arange(0, BLOCK_N)  # [BN] rows of this tile
            r_ok = r < stop
            cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            col_ok = cols < M
            x_rows = rows_ptr + r.to(tl.int64)[:, None] * rows_stride  # [BN, 1]
            # W^T[k, m] sits at w[group, m, k]; int64: S M K passes 2^31 for large expert sets
            w_cols = w_ptr + group.to(tl.int64) * M * K + cols.to(tl.int64)[None, :] * K  # [1, BM]
            # tl.full, not tl.zeros: a jitted helper the interpreter does not patch when tl is a closure
            acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)  # [BK]
                k_ok = k < K
                xt = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
                wt = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BM]
                if UPCAST:
                    xt, wt = xt.to(tl.float32), wt.to(tl.float32)
                acc += tl.dot(xt, wt, input_precision=PRECISION)
            tl.store(out_ptr + r.to(tl.int64)[:, None] * M + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & col_ok[None, :])

    return grouped_gemm
