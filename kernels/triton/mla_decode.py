"""MLA attention (DeepSeek-V2/V3's absorbed form) over a paged latent KV pool on the GPU, in
Triton, and its torch references.

A pool layer kv [S, 1, Dk] holds one latent row per token, Dk = kv_lora_rank + rope dim (576 =
512 + 64). Every query head scores all Dk columns of a row and takes its first v_dim (=
kv_lora_rank) columns as the value: MQA with one KV head, output [.., H, v_dim]. Position p of
request (item) b lives in slot page_table[b, p // page_size] * page_size + p % page_size.

mla_decode_attention(q [B, H, Dk], kv, page_table [B, P], kv_lens [B], page_size, scale, v_dim)
→ [B, H, v_dim]: request b's one query over positions 0 .. kv_lens[b] - 1 (0: a zero row). One
program per (request, block of 16 heads, KV split), so a row is read once per 16 heads: tl.dot
of the head block with the row's latent part and its rope part (each padded to a power of two,
Dk need not be one), the latent tile reused as the value tile. Split-K as in
decode_attention.py, whose split count heuristic and reduce kernel this module reuses.

mla_extend_attention(q [T, H, Dk], kv, page_table, cu_q [B + 1], start_pos [B], page_size,
scale, v_dim) → [T, H, v_dim]: item i's queries, rows cu_q[i] .. cu_q[i+1] - 1 at positions
start_pos[i] + 0, 1, ..., causal over positions 0 .. start_pos[i] + j. One program per (tile of
BLOCK_M (query, head) rows of one item, item): the heads of a query are consecutive rows, so a
KV tile is read once for all of them.

FP8 pools: rows widened through float32 to q's dtype (the interpreter's e5m2 subnormals, see
decode_attention.py), the scale folded into the score scale and the output; the Hadamard
rotation is the caller's. Triton is imported on first use; the references need only torch.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.kv_fp8 import FP8_KV_SCALES, widen_kv
from kernels.triton import decode_attention as da
from kernels.triton import import_triton, jitted

BLOCK_H = 16  # query heads per decode program (tl.dot's smallest side; fewer heads are padded)


def mla_decode_attention(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
                         page_size: int, scale: float, v_dim: int, *, num_splits: int | None = None,
                         max_kv_len: int | None = None) -> torch.Tensor:
    """q [B, H, Dk] float32/bfloat16/float16 (rows and heads may be strided, the last dim
    contiguous); kv [S, 1, Dk] of q's dtype or an FP8 one, last dim contiguous; page_table [B, P]
    int32/int64; kv_lens [B] int32/int64 in [0, P page_size]; 1 <= v_dim <= Dk. num_splits:
    split-K chunks (None: decode_attention.choose_num_splits from max_kv_len, computed from
    kv_lens when not given, a device sync). → [B, H, v_dim], q's dtype. ValueError on a bad
    shape, stride, dtype, device or (CPU tensors) index; RuntimeError without triton."""
    triton = _triton()
    check_mla(q, kv, page_table, kv_lens.shape, page_size, scale, v_dim, "kv_lens")
    if kv_lens.dim() != 1 or kv_lens.dtype not in da.INDEX_DTYPES or kv_lens.device != q.device:
        raise ValueError(f"kv_lens must be [B] int32/int64 on {q.device}, got {list(kv_lens.shape)} "
                         f"{kv_lens.dtype} on {kv_lens.device}")
    if q.shape[0] != kv_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} requests, kv_lens {kv_lens.shape[0]}: they must match")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    _check_device(q, triton)
    if q.device.type == "cpu":
        da.check_pages(page_table, kv_lens, page_size, kv.shape[0], "kv_lens")
    B, H, dk = q.shape
    out = torch.empty(B, H, v_dim, dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    kv_lens = kv_lens.contiguous()
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    blocks = triton.cdiv(H, BLOCK_H)
    splits = num_splits or da.choose_num_splits(B, blocks, max_kv_len, q.device)
    one = splits == 1
    m = l = acc = out  # stand-ins the one-split kernel never touches
    if not one:  # decode_attention.py's layout, for its reduce kernel
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        l = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        acc = torch.empty(B, H, splits, v_dim, dtype=torch.float32, device=q.device)
    interp = bool(triton.knobs.runtime.interpret)
    upcast = interp and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (lora_sgmv.py)
    kv_scale = FP8_KV_SCALES.get(kv.dtype, 1.0)
    block_v = da._block_d(v_dim)
    _kernels(interp)[0][(B, blocks, splits)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), page_table, page_table.stride(0), kv_lens, m, l, acc, out,
        H, v_dim, dk - v_dim, page_size, scale * kv_scale * da.LOG2E, kv_scale, splits,
        BLOCK_H=BLOCK_H, BLOCK_N=32 if block_v >= 256 else 64, BLOCK_V=block_v, BLOCK_R=da._block_d(dk - v_dim),
        ONE_SPLIT=one, FP8=kv.dtype in FP8_KV_SCALES, UPCAST=upcast, PRECISION=da._precision(q.dtype, upcast))
    if not one:
        da._kernels(interp)[1][(B, H)](m, l, acc, out, out.stride(0), out.stride(1), H, v_dim, splits,
                                       BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_v)
    return out


def mla_extend_attention(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, cu_q: torch.Tensor,
                         start_pos: torch.Tensor, page_size: int, scale: float, v_dim: int, *,
                         max_q_len: int | None = None) -> torch.Tensor:
    """q [T, H, Dk] (as for decode); kv, page_table as for decode; cu_q [B + 1] and start_pos [B]
    int32/int64 (cu_q rises from 0 to T; start_pos + q_len <= P page_size); max_q_len: the
    longest item (computed from cu_q when not given, a device sync). → [T, H, v_dim], q's dtype.
    ValueError on a bad shape, stride, dtype, device or (CPU tensors) index."""
    triton = _triton()
    check_mla(q, kv, page_table, start_pos.shape, page_size, scale, v_dim, "start_pos")
    for name, t, n in (("cu_q", cu_q, page_table.shape[0] + 1), ("start_pos", start_pos, page_table.shape[0])):
        if t.dim() != 1 or t.shape[0] != n or t.dtype not in da.INDEX_DTYPES or t.device != q.device:
            raise ValueError(f"{name} must be [{n}] int32/int64 on {q.device}, got {list(t.shape)} {t.dtype} "
                             f"on {t.device}")
    _check_device(q, triton)
    if q.device.type == "cpu":
        q_lens = cu_q[1:] - cu_q[:-1]
        if cu_q[0] != 0 or cu_q[-1] != q.shape[0] or (q_lens < 0).any():
            raise ValueError(f"cu_q must rise from 0 to T = {q.shape[0]}, got {cu_q.tolist()}")
        if (start_pos < 0).any():
            raise ValueError(f"start_pos must be >= 0, got {start_pos.tolist()}")
        da.check_pages(page_table, start_pos + q_lens, page_size, kv.shape[0], "start_pos + q_len")
    T, H, dk = q.shape
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    B = page_table.shape[0]
    if T == 0 or H == 0 or B == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    interp = bool(triton.knobs.runtime.interpret)
    upcast = interp and q.dtype == torch.bfloat16
    kv_scale = FP8_KV_SCALES.get(kv.dtype, 1.0)
    block_v = da._block_d(v_dim)
    block_m = 32 if block_v >= 256 else 64
    _kernels(interp)[1][(triton.cdiv(max_q_len * H, block_m), B)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), page_table, page_table.stride(0), cu_q.contiguous(),
        start_pos.contiguous(), out, H, v_dim, dk - v_dim, page_size, scale * kv_scale * da.LOG2E, kv_scale,
        BLOCK_M=block_m, BLOCK_N=32 if block_v >= 256 else 64, BLOCK_V=block_v, BLOCK_R=da._block_d(dk - v_dim),
        FP8=kv.dtype in FP8_KV_SCALES, UPCAST=upcast, PRECISION=da._precision(q.dtype, upcast))
    return out


def mla_decode_reference(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
                         page_size: int, scale: float, v_dim: int) -> torch.Tensor:
    """The decode contract in float32 torch, one request at a time, on any device → [B, H, v_dim]."""
    check_mla(q, kv, page_table, kv_lens.shape, page_size, scale, v_dim, "kv_lens")
    out = torch.zeros(*q.shape[:2], v_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(kv_lens.tolist()):
        if n:
            rows = paged_latent_rows(kv, page_table[b], n, page_size)
            out[b] = attend_latent(q[b:b + 1].float(), torch.tensor([n - 1]), rows, scale, v_dim)[0]
    return out.to(q.dtype)


def mla_extend_reference(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, cu_q: torch.Tensor,
                         start_pos: torch.Tensor, page_size: int, scale: float, v_dim: int) -> torch.Tensor:
    """The extend contract in float32 torch, one item at a time, on any device → [T, H, v_dim]."""
    check_mla(q, kv, page_table, start_pos.shape, page_size, scale, v_dim, "start_pos")
    out = torch.zeros(*q.shape[:2], v_dim, dtype=torch.float32, device=q.device)
    bounds, starts = cu_q.tolist(), start_pos.tolist()
    for i, start in enumerate(starts):
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            rows = paged_latent_rows(kv, page_table[i], start + hi - lo, page_size)
            out[lo:hi] = attend_latent(q[lo:hi].float(), torch.arange(start, start + hi - lo), rows, scale, v_dim)
    return out.to(q.dtype)


def paged_latent_rows(kv: torch.Tensor, pages: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Positions 0 .. n - 1 of one request (its page-table row `pages`) → rows [n, Dk] float32,
    FP8 ones times their scale (still rotated)."""
    pos = torch.arange(n, device=pages.device)
    slots = (pages.long()[pos // page_size] * page_size + pos % page_size).to(kv.device)
    flat = kv[:, 0]
    rows = flat.view(torch.uint8)[slots].view(kv.dtype) if kv.element_size() == 1 else flat[slots]  # as bytes: FP8
    return widen_kv(rows, torch.float32)


def attend_latent(q: torch.Tensor, q_pos: torch.Tensor, rows: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """q [n, H, Dk] float32 at positions q_pos [n] over rows [L, Dk] float32 at 0 .. L - 1, causal
    → [n, H, v_dim] float32 (values: the rows' first v_dim columns)."""
    scores = torch.einsum("nhd,ld->hnl", q, rows) * scale  # [H, n, L]
    visible = torch.arange(rows.shape[0], device=q.device)[None, :] <= q_pos.to(q.device)[:, None]  # [n, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnl,ld->nhd", probs, rows[:, :v_dim])


def check_mla(q, kv, page_table, lens_shape, page_size, scale, v_dim, what) -> None:
    """The shapes, strides, dtypes and devices both kernels share (no device sync)."""
    if q.dim() != 3 or q.dtype not in da.DTYPES:
        raise ValueError(f"q must be [N, H, Dk] float32/bfloat16/float16, got {list(q.shape)} {q.dtype}")
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != q.shape[2]:
        raise ValueError(f"kv must be one latent pool layer [S, 1, Dk = {q.shape[2]}], got {list(kv.shape)}")
    if kv.dtype != q.dtype and kv.dtype not in FP8_KV_SCALES:
        raise ValueError(f"the pool's dtype {kv.dtype} must be q's ({q.dtype}) or an FP8 one")
    if not 1 <= v_dim <= q.shape[2]:
        raise ValueError(f"v_dim must be in [1, Dk = {q.shape[2]}], got {v_dim}")
    for name, t in (("q", q), ("kv", kv), ("page_table", page_table)):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if page_table.dim() != 2 or page_table.dtype not in da.INDEX_DTYPES:
        raise ValueError(f"page_table must be [B, P] int32/int64, got {list(page_table.shape)} {page_table.dtype}")
    if page_table.shape[0] != lens_shape[0]:
        raise ValueError(f"page_table has {page_table.shape[0]} rows, {what} {lens_shape[0]}: they must match")
    if page_size < 1 or kv.shape[0] % page_size:
        raise ValueError(f"page_size must be >= 1 and divide the pool's {kv.shape[0]} slots, got {page_size}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    for name, t in (("kv", kv), ("page_table", page_table)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: move it first")


def _check_device(q: torch.Tensor, triton: Any) -> None:
    if not q.is_cuda and not (q.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"q is on {q.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")


def _triton() -> Any:
    return import_triton("MLA attention", "mla_decode_reference / mla_extend_reference")


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """(decode, extend) jitted for this interpreter setting (kernels.triton.jitted says why)."""
    return jitted(interpret, _decode_source, _extend_source)


def _decode_source(tl: Any) -> Any:
    def decode(q_ptr, q_stride_b, q_stride_h, kv_ptr, kv_stride_s, table_ptr, table_stride, lens_ptr, m_ptr, l_ptr,
               acc_ptr, out_ptr, num_heads, v_dim, rope_dim, page_size, qk_scale, kv_scale, num_splits,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
               ONE_SPLIT: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (request, head block, split): scores of the block's heads over the split's rows,
        latent part + rope part, online softmax in float32 with log2-unit maxima (qk_scale
        carries log2 e and the FP8 scale); the latent tile is the value tile. tl.reduce with
        tl.standard's combine functions, as decode_attention.py explains."""
        b = tl.program_id(0)
        block = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(lens_ptr + b).to(tl.int32)
        chunk = (kv_len + num_splits - 1) // num_splits
        begin = split * chunk
        end = tl.minimum(begin + chunk, kv_len)
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = heads < num_heads
        dv = tl.arange(0, BLOCK_V)
        dv_ok = dv < v_dim
        dr = tl.arange(0, BLOCK_R)
        dr_ok = dr < rope_dim
        q_row = b.to(tl.int64) * q_stride_b + heads * q_stride_h  # [BH]
        qn = tl.load(q_ptr + q_row[:, None] + dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
        qr = tl.load(q_ptr + q_row[:, None] + v_dim + dr[None, :], mask=h_ok[:, None] & dr_ok[None, :], other=0.0)
        if UPCAST:
            qn = qn.to(tl.float32)
            qr = qr.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
        acc = tl.full([BLOCK_H, BLOCK_V], 0.0, tl.float32)
        for start in range(begin, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BN]
            ok = pos < end
            page = tl.load(table_ptr + b * table_stride + pos // page_size, mask=ok, other=0).to(tl.int64)
            row = (page * page_size + pos % page_size) * kv_stride_s  # [BN]
            kn = tl.load(kv_ptr + row[:, None] + dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
            kr = tl.load(kv_ptr + row[:, None] + v_dim + dr[None, :], mask=ok[:, None] & dr_ok[None, :], other=0.0)
            if FP8:
                kn = kn.to(tl.float32).to(q_ptr.dtype.element_ty)
                kr = kr.to(tl.float32).to(q_ptr.dtype.element_ty)
            if UPCAST:
                kn = kn.to(tl.float32)
                kr = kr.to(tl.float32)
            s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
            s = (s + tl.dot(qr, tl.trans(kr), input_precision=PRECISION)) * qk_scale  # [BH, BN], log2 units
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))  # finite: a key per step
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            pv = p.to(kn.dtype)
            if UPCAST:
                pv = p.to(tl.bfloat16).to(tl.float32)  # the rounding a GPU's bf16 dot takes
            acc = acc * alpha[:, None] + tl.dot(pv, kn, input_precision=PRECISION)
            m_i = m_new
        acc = acc * kv_scale
        if ONE_SPLIT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_row = (b * num_heads + heads).to(tl.int64)  # out is [B, H, v_dim] contiguous
            tl.store(out_ptr + out_row[:, None] * v_dim + dv[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & dv_ok[None, :])
        else:
            part = (b * num_heads + heads) * num_splits + split  # [BH]: (b, h, split)
            tl.store(m_ptr + part, m_i, mask=h_ok)
            tl.store(l_ptr + part, l_i, mask=h_ok)
            tl.store(acc_ptr + part.to(tl.int64)[:, None] * v_dim + dv[None, :], acc,
                     mask=h_ok[:, None] & dv_ok[None, :])

    return decode


def _extend_source(tl: Any) -> Any:
    def extend(q_ptr, q_stride_t, q_stride_h, kv_ptr, kv_stride_s, table_ptr, table_stride, cu_ptr, start_ptr,
               out_ptr, num_heads, v_dim, rope_dim, page_size, qk_scale, kv_scale, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (tile, item): rows r = tile BLOCK_M + 0, 1, ... of the item's q_len x H (query, head)
        pairs, query r // H, head r % H; the keys up to the tile's last query, causal per row."""
        tile = tl.program_id(0)
        item = tl.program_id(1)
        q_begin = tl.load(cu_ptr + item).to(tl.int32)
        q_len = tl.load(cu_ptr + item + 1).to(tl.int32) - q_begin
        total = q_len * num_heads
        r0 = tile * BLOCK_M
        if r0 < total:  # the grid covers the longest item; shorter ones' spare tiles do nothing
            start = tl.load(start_ptr + item).to(tl.int32)
            r = r0 + tl.arange(0, BLOCK_M)
            r_ok = r < total
            t = r // num_heads
            h = r % num_heads
            q_pos = start + t  # [BM]
            dv = tl.arange(0, BLOCK_V)
            dv_ok = dv < v_dim
            dr = tl.arange(0, BLOCK_R)
            dr_ok = dr < rope_dim
            q_row = (q_begin + t).to(tl.int64) * q_stride_t + h * q_stride_h  # [BM]
            qn = tl.load(q_ptr + q_row[:, None] + dv[None, :], mask=r_ok[:, None] & dv_ok[None, :], other=0.0)
            qr = tl.load(q_ptr + q_row[:, None] + v_dim + dr[None, :], mask=r_ok[:, None] & dr_ok[None, :],
                         other=0.0)
            if UPCAST:
                qn = qn.to(tl.float32)
                qr = qr.to(tl.float32)
            hi = start + (tl.minimum(r0 + BLOCK_M, total) - 1) // num_heads + 1  # past the tile's last query
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, BLOCK_V], 0.0, tl.float32)
            for j0 in range(0, hi, BLOCK_N):
                pos = j0 + tl.arange(0, BLOCK_N)  # [BN]
                ok = pos < hi
                page = tl.load(table_ptr + item * table_stride + pos // page_size, mask=ok, other=0).to(tl.int64)
                row = (page * page_size + pos % page_size) * kv_stride_s
                kn = tl.load(kv_ptr + row[:, None] + dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
                kr = tl.load(kv_ptr + row[:, None] + v_dim + dr[None, :], mask=ok[:, None] & dr_ok[None, :],
                             other=0.0)
                if FP8:
                    kn = kn.to(tl.float32).to(q_ptr.dtype.element_ty)
                    kr = kr.to(tl.float32).to(q_ptr.dtype.element_ty)
                if UPCAST:
                    kn = kn.to(tl.float32)
                    kr = kr.to(tl.float32)
                s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
                s = (s + tl.dot(qr, tl.trans(kr), input_precision=PRECISION)) * qk_scale  # [BM, BN]
                s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row that has seen nothing
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
                pv = p.to(kn.dtype)
                if UPCAST:
                    pv = p.to(tl.bfloat16).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(pv, kn, input_precision=PRECISION)
                m_i = m_new
            o = acc * kv_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_row = ((q_begin + t).to(tl.int64) * num_heads + h) * v_dim  # out is [T, H, v_dim] contiguous
            tl.store(out_ptr + out_row[:, None] + dv[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & dv_ok[None, :])

    return extend
