"""Every LoRA slot of a step applied to one linear's output on the GPU (an SGMV in Triton), with
the same argument contract and weight layouts as the fused CPU kernel (kernels/lora_cpu.py), so
services/worker/lora/fused.py holds and calls either one.

lora_apply_(x, y, a, b, segs, order, groups): y[order[i]] += sum over the slot's segments of
B[lo:hi, c0:c1] A[c0:c1] x[order[i]], in place. Layouts (lora_cpu's, per slot s):
  a [S, ceil(in/2), Wp, 2]: A [Wp, in] transposed, input pairs interleaved (lora_cpu.pack_a);
  b [S, Wp/2, out, 2]: scaled B transposed, rank pairs interleaved (lora_cpu.pack_b);
  segs int32 [S, NSEG, 4]: (lo, hi, c0, c1), output rows [lo, hi) take rank columns [c0, c1);
  order int32 [n]: distinct rows of x and y grouped by slot; groups int32 [G, 3]: (slot, begin, end).
Rows not in order are never read or written (base-only rows), nor are y's columns no segment covers.

Two launches, as SGMV does it: the shrink h = A x for tiles of BLOCK_M rows of one slot (float32
sums, h [n, Wp] float32 in a scratch buffer), then the expand y += B h for tiles of one slot's
rows x BLOCK_N output columns, over the segments that meet the tile (float32 sums, one rounding
into y). On bfloat16/float16 h is rounded to that dtype before the expand, as the CPU kernel and
the torch path round it, so the expand runs on tensor cores. A program finds its slot's tile by
scanning groups (G <= --max-loras), so launching needs no device-to-host copy: the grid has
ceil(n / BLOCK_M) + G row tiles, the most G slots' ragged tiles can take, and the spare ones exit.

Difference from the CPU entry point: on a CUDA device the values of order, groups and segs are
trusted (checking them would cost a device sync per linear; services/worker/lora/batch.py and
fused.py build them); on CPU tensors (the interpreter) they are checked. Errors are ValueErrors
here where the C++ extension raises RuntimeError.

The reference is lora_cpu.lora_apply_reference (float32 torch), re-exported here. Triton is
imported on first use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.lora_cpu import lora_apply_reference  # noqa: F401  (the reference beside the kernel)
from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # rows of one slot per tile (tl.dot's smallest side)
BLOCK_K = 64  # input features per shrink step
BLOCK_W = 64  # rank columns per shrink program
BLOCK_R = 16  # rank columns per expand step
BLOCK_N = 64  # output columns per expand program


def lora_apply_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: torch.Tensor,
                order: torch.Tensor, groups: torch.Tensor) -> None:
    """x [T, in], y [T, out] one dtype (float32/bfloat16/float16; rows may be strided, the last
    dim contiguous), a, b, segs, order, groups as in the module docstring, all on one CUDA device
    (CPU tensors only under TRITON_INTERPRET=1). Adds each listed row's delta into y in place.
    Raises ValueError on a bad shape, stride, dtype, device or (CPU tensors) index; RuntimeError
    without triton."""
    triton = _triton()
    _check(x, y, a, b, segs, order, groups)
    if not x.is_cuda and not (x.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"x is on {x.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if x.device.type == "cpu":
        _check_values(x, y, a, segs, order, groups)
    n, n_groups, wp, n_out = order.shape[0], groups.shape[0], a.shape[2], y.shape[1]
    if n == 0 or n_groups == 0 or wp == 0 or segs.shape[1] == 0 or n_out == 0:
        return
    shrink, expand = _kernels(triton.knobs.runtime.interpret)
    # triton 3.9's interpreter multiplies bfloat16 blocks as their int16 bits: there both sides go
    # to float32 first (exact products, the same float32 sums), on a GPU they stay bfloat16.
    upcast = bool(triton.knobs.runtime.interpret) and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for half inputs
    h = torch.empty(n, wp, dtype=torch.float32, device=x.device)  # [n, Wp]
    tiles = triton.cdiv(n, BLOCK_M) + n_groups
    shrink[(tiles, triton.cdiv(wp, BLOCK_W))](
        x, x.stride(0), a, h, segs, order, groups, n_groups, x.shape[1], wp, segs.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_W=BLOCK_W, PRECISION=precision, UPCAST=upcast)
    expand[(tiles, triton.cdiv(n_out, BLOCK_N))](
        y, y.stride(0), b, h, segs, order, groups, n_groups, n_out, wp, segs.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, PRECISION=precision, UPCAST=upcast)


def _check(x, y, a, b, segs, order, groups) -> None:
    """Shapes, strides, dtypes and devices, as ValueErrors a caller can act on (no device sync)."""
    if x.dim() != 2 or y.dim() != 2 or x.dtype not in DTYPES or y.dtype != x.dtype:
        raise ValueError(f"x and y must be [T, in] and [T, out] of one dtype (float32/bfloat16/float16), "
                         f"got {list(x.shape)} {x.dtype} and {list(y.shape)} {y.dtype}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, y {y.shape[0]}: they must match")
    for name, t in (("x", x), ("y", y)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    n_in, n_out = x.shape[1], y.shape[1]
    if a.dim() != 4 or a.shape[1] != (n_in + 1) // 2 or a.shape[3] != 2 or a.shape[2] % 2:
        raise ValueError(f"a must be [S, ceil(in/2) = {(n_in + 1) // 2}, Wp (even), 2], got {list(a.shape)}")
    if b.dim() != 4 or list(b.shape) != [a.shape[0], a.shape[2] // 2, n_out, 2]:
        raise ValueError(f"b must be [S, Wp/2, out, 2] = {[a.shape[0], a.shape[2] // 2, n_out, 2]}, "
                         f"got {list(b.shape)}")
    if a.dtype != x.dtype or b.dtype != x.dtype:
        raise ValueError(f"a ({a.dtype}) and b ({b.dtype}) must have x's dtype {x.dtype}")
    if segs.dim() != 3 or segs.shape[0] != a.shape[0] or segs.shape[2] != 4:
        raise ValueError(f"segs must be [S = {a.shape[0]}, NSEG, 4], got {list(segs.shape)}")
    if order.dim() != 1 or groups.dim() != 2 or groups.shape[1] != 3:
        raise ValueError(f"order must be [n] and groups [G, 3], got {list(order.shape)} and {list(groups.shape)}")
    for name, t in (("segs", segs), ("order", order), ("groups", groups)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("a", a), ("b", b), ("segs", segs), ("order", order), ("groups", groups)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: move it first")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device}, x on {x.device}: move it first")


def _check_values(x, y, a, segs, order, groups) -> None:
    """The indices, for CPU tensors (on a GPU this would cost a sync per call)."""
    T, n, S, wp = x.shape[0], order.shape[0], a.shape[0], a.shape[2]
    if n and (order.min() < 0 or order.max() >= T or order.unique().numel() != n):
        raise ValueError(f"order must hold distinct rows in [0, {T})")
    for slot, begin, end in groups.tolist():
        if not (0 <= slot < S and 0 <= begin <= end <= n):
            raise ValueError(f"groups row ({slot}, {begin}, {end}) out of range: {S} slots, {n} ordered rows")
    lo, hi, c0, c1 = segs.reshape(-1, 4).t()
    if segs.numel() and not ((0 <= lo) & (lo <= hi) & (hi <= y.shape[1]) & (0 <= c0) & (c0 <= c1) & (c1 <= wp)).all():
        raise ValueError(f"segs need 0 <= lo <= hi <= out = {y.shape[1]} and 0 <= c0 <= c1 <= Wp = {wp}")


def _triton() -> Any:
    return import_triton("LoRA SGMV", "lora_apply_reference")


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """(shrink, expand) jitted for this interpreter setting (kernels.triton.jitted)."""
    return jitted(interpret, _shrink_source, _expand_source)


def _shrink_source(tl: Any) -> Any:
    def shrink(x_ptr, x_stride, a_ptr, h_ptr, segs_ptr, order_ptr, groups_ptr, n_groups, n_in, wp, n_seg,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
        """h[pos, cols] = A[slot, cols] x[order[pos]] for one row tile x BLOCK_W rank columns."""
        # Row tile program_id(0) → (slot, its first position in order, the slot's end); slot -1
        # past the last tile. Slot g's rows take ceil(len / BLOCK_M) tiles, in groups' order.
        # (Inlined in both kernels: the interpreter does not resolve a jitted helper in a closure.)
        tile = tl.program_id(0)
        slot = tl.full((), -1, tl.int32)
        start = tl.full((), 0, tl.int32)
        end = tl.full((), 0, tl.int32)
        seen = tl.full((), 0, tl.int32)  # tiles of the groups before g
        for g in range(n_groups):
            begin = tl.load(groups_ptr + g * 3 + 1)
            stop = tl.load(groups_ptr + g * 3 + 2)
            count = (stop - begin + BLOCK_M - 1) // BLOCK_M
            hit = (tile >= seen) & (tile < seen + count)
            slot = tl.where(hit, tl.load(groups_ptr + g * 3), slot)
            start = tl.where(hit, begin + (tile - seen) * BLOCK_M, start)
            end = tl.where(hit, stop, end)
            seen += count
        width = tl.full((), 0, tl.int32)  # the slot's used rank columns: max c1 (0: an empty slot)
        for j in range(n_seg):
            width = tl.maximum(width, tl.load(segs_ptr + (tl.maximum(slot, 0) * n_seg + j) * 4 + 3))
        col0 = tl.program_id(1) * BLOCK_W
        if (slot >= 0) & (col0 < width):
            pos = start + tl.arange(0, BLOCK_M)  # [BM] positions in order
            row_ok = pos < end
            rows = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
            cols = col0 + tl.arange(0, BLOCK_W)  # [BW]
            col_ok = cols < width
            a_slot = a_ptr + slot.to(tl.int64) * ((n_in + 1) // 2) * wp * 2
            # tl.full, not tl.zeros: a jitted helper the interpreter does not patch when tl is a closure
            acc = tl.full([BLOCK_M, BLOCK_W], 0.0, tl.float32)
            for k0 in range(0, n_in, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)  # [BK]
                k_ok = k < n_in
                xt = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                # A[c, k] sits at a[slot, k // 2, c, k % 2]
                at = tl.load(a_slot + (k // 2)[:, None] * (wp * 2) + cols[None, :] * 2 + (k % 2)[:, None],
                             mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BW]
                if UPCAST:
                    xt, at = xt.to(tl.float32), at.to(tl.float32)
                acc += tl.dot(xt, at, input_precision=PRECISION)
            tl.store(h_ptr + pos.to(tl.int64)[:, None] * wp + cols[None, :], acc,
                     mask=row_ok[:, None] & col_ok[None, :])

    return shrink


def _expand_source(tl: Any) -> Any:
    def expand(y_ptr, y_stride, b_ptr, h_ptr, segs_ptr, order_ptr, groups_ptr, n_groups, n_out, wp, n_seg,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
        """y[order[pos], cols] += the segments' B[cols, c0:c1] h[pos, c0:c1] for one row tile x
        BLOCK_N output columns; columns no segment covers are not written."""
        # Row tile program_id(0) → (slot, its first position in order, the slot's end); slot -1
        # past the last tile. Slot g's rows take ceil(len / BLOCK_M) tiles, in groups' order.
        # (Inlined in both kernels: the interpreter does not resolve a jitted helper in a closure.)
        tile = tl.program_id(0)
        slot = tl.full((), -1, tl.int32)
        start = tl.full((), 0, tl.int32)
        end = tl.full((), 0, tl.int32)
        seen = tl.full((), 0, tl.int32)  # tiles of the groups before g
        for g in range(n_groups):
            begin = tl.load(groups_ptr + g * 3 + 1)
            stop = tl.load(groups_ptr + g * 3 + 2)
            count = (stop - begin + BLOCK_M - 1) // BLOCK_M
            hit = (tile >= seen) & (tile < seen + count)
            slot = tl.where(hit, tl.load(groups_ptr + g * 3), slot)
            start = tl.where(hit, begin + (tile - seen) * BLOCK_M, start)
            end = tl.where(hit, stop, end)
            seen += count
        if slot >= 0:
            pos = start + tl.arange(0, BLOCK_M)  # [BM]
            row_ok = pos < end
            rows = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
            col_ok = cols < n_out
            b_slot = b_ptr + slot.to(tl.int64) * (wp // 2) * n_out * 2
            acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
            covered = tl.full([BLOCK_N], 0, tl.int32)  # [BN] > 0: some segment covers the column
            for j in range(n_seg):
                seg = segs_ptr + (slot * n_seg + j) * 4
                lo, hi = tl.load(seg), tl.load(seg + 1)
                c0, c1 = tl.load(seg + 2), tl.load(seg + 3)
                mine = col_ok & (cols >= lo) & (cols < hi)
                covered += tl.where(mine & (c1 > c0), 1, 0)
                for r0 in range(c0, c1, BLOCK_R):
                    r = r0 + tl.arange(0, BLOCK_R)  # [BR]
                    r_ok = r < c1
                    ht = tl.load(h_ptr + pos.to(tl.int64)[:, None] * wp + r[None, :],
                                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BM, BR] float32
                    # B^T[c, o] sits at b[slot, c // 2, o, c % 2]
                    bt = tl.load(b_slot + (r // 2)[:, None] * (n_out * 2) + cols[None, :] * 2 + (r % 2)[:, None],
                                 mask=r_ok[:, None] & mine[None, :], other=0.0)  # [BR, BN]
                    hb = ht.to(bt.dtype)  # h rounded to the weights' dtype, as the CPU kernel rounds it
                    if UPCAST:
                        hb, bt = hb.to(tl.float32), bt.to(tl.float32)
                    acc += tl.dot(hb, bt, input_precision=PRECISION)
            where = y_ptr + rows[:, None] * y_stride + cols[None, :]
            write = row_ok[:, None] & (covered > 0)[None, :]
            old = tl.load(where, mask=write, other=0.0)
            tl.store(where, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=write)

    return expand
