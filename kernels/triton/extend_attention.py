"""Prefill/extend attention over a cached prefix on the GPU, ragged batch, in Triton, and its
torch reference.

extend_attention(q [T, H, D], k, v [S, Hkv, D], page_table [B, P], cu_q [B + 1], start_pos [B],
page_size, scale) → [T, H, D] in q's dtype. Item i's queries are rows cu_q[i] .. cu_q[i+1] - 1
of q, at positions start_pos[i] + 0, 1, ...; its keys are positions 0 .. start_pos[i] + q_len - 1
of the pool (the cached prefix, then this step's own K/V, already written), position p in slot
page_table[i, p // page_size] * page_size + p % page_size. A query at position p sees keys
at positions <= p (and, with a sliding window W, > p - W); a Gemma 2 soft-cap c maps scores to
c tanh(scores / c) before the mask. GQA: query head h reads KV head h // (H / Hkv).

One program per (tile of BLOCK_M queries of one item, query head): flash attention over the
keys the tile can see (from the window's start to its last query), online softmax in float32
with log2-unit maxima; rows of q and the output may be strided (a view of a fused projection).
FP8 pools are widened in the kernel with the scale folded into the score scale and output, the
rotation left to the caller, as in decode_attention.py, whose shape checks and reference this
module shares.

The grid needs the longest q_len as a host int (max_q_len; computed from cu_q when not given,
a device sync). Triton is imported on first use; the reference needs only torch.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.kv_fp8 import FP8_KV_SCALES
from kernels.triton import import_triton, jitted
from kernels.triton.decode_attention import (INDEX_DTYPES, LOG2E, _block_d, _precision, attend_reference,
                                             check_pages, check_paged, paged_rows)

BLOCK_N = 64  # keys per step of a program


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                     cu_q: torch.Tensor, start_pos: torch.Tensor, page_size: int, scale: float, *,
                     window: int | None = None, softcap: float | None = None,
                     max_q_len: int | None = None) -> torch.Tensor:
    """q [T, H, D] float32/bfloat16/float16 (last dim contiguous); k, v [S, Hkv, D] of q's dtype
    or one FP8 dtype, equal strides, last dim contiguous; page_table [B, P] int32/int64 (last
    dim contiguous); cu_q [B + 1] and start_pos [B] int32/int64 (cu_q[0] = 0, non-decreasing,
    cu_q[B] = T; start_pos + q_len <= P page_size). All on one CUDA device (CPU tensors only
    under TRITON_INTERPRET=1). → [T, H, D], q's dtype. Raises ValueError on a bad shape, stride,
    dtype, device or (CPU tensors) index; RuntimeError without triton."""
    triton = _triton()
    check_paged(q, k, v, page_table, start_pos.shape, page_size, scale, window, softcap, what="start_pos")
    for name, t, n in (("cu_q", cu_q, page_table.shape[0] + 1), ("start_pos", start_pos, page_table.shape[0])):
        if t.dim() != 1 or t.shape[0] != n or t.dtype not in INDEX_DTYPES or t.device != q.device:
            raise ValueError(f"{name} must be [{n}] int32/int64 on {q.device}, got {list(t.shape)} {t.dtype} "
                             f"on {t.device}")
    if not q.is_cuda and not (q.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"q is on {q.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if q.device.type == "cpu":
        q_lens = cu_q[1:] - cu_q[:-1]
        if cu_q[0] != 0 or cu_q[-1] != q.shape[0] or (q_lens < 0).any():
            raise ValueError(f"cu_q must rise from 0 to T = {q.shape[0]}, got {cu_q.tolist()}")
        if (start_pos < 0).any():
            raise ValueError(f"start_pos must be >= 0, got {start_pos.tolist()}")
        check_pages(page_table, start_pos + q_lens, page_size, k.shape[0], "start_pos + q_len")
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    B = page_table.shape[0]
    if T == 0 or H == 0 or B == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    interp = bool(triton.knobs.runtime.interpret)
    upcast = interp and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (lora_sgmv.py)
    kv_scale = FP8_KV_SCALES.get(k.dtype, 1.0)
    block_m = 64 if D <= 128 else 32
    _kernel(interp)[(triton.cdiv(max_q_len, block_m), H, B)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), page_table, page_table.stride(0),
        cu_q.contiguous(), start_pos.contiguous(), out, H, H // k.shape[1], D, page_size,
        scale * kv_scale * LOG2E, kv_scale, window or 0, (softcap or 1.0) * LOG2E,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N if D <= 128 else 32, BLOCK_D=_block_d(D),
        USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
        FP8=k.dtype in FP8_KV_SCALES, UPCAST=upcast, PRECISION=_precision(q.dtype, upcast))
    return out


def extend_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                               cu_q: torch.Tensor, start_pos: torch.Tensor, page_size: int, scale: float, *,
                               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The same in float32 torch, one item at a time, on any device → [T, H, D] q's dtype."""
    check_paged(q, k, v, page_table, start_pos.shape, page_size, scale, window, softcap, what="start_pos")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds, starts = cu_q.tolist(), start_pos.tolist()
    for i, start in enumerate(starts):
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            keys, values = paged_rows(k, v, page_table[i], start + hi - lo, page_size)
            pos = torch.arange(start, start + hi - lo)
            out[lo:hi] = attend_reference(q[lo:hi].float(), pos, keys, values, scale, window, softcap)
    return out.to(q.dtype)


def _triton() -> Any:
    return import_triton("extend attention", "extend_attention_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _extend_source)[0]


def _extend_source(tl: Any) -> Any:
    def extend(q_ptr, q_stride_t, q_stride_h, k_ptr, v_ptr, kv_stride_s, kv_stride_h, table_ptr, table_stride,
               cu_ptr, start_ptr, out_ptr, num_heads, group, head_dim, page_size, qk_scale, kv_scale, window, softcap,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
               USE_SOFTCAP: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (query tile, head, item). qk_scale carries log2 e and the K scale, softcap log2 e;
        tl.reduce with tl.standard's combine functions, not tl.max / tl.sum: those are jitted
        helpers the interpreter cannot call once triton was imported with it off."""
        tile = tl.program_id(0)
        h = tl.program_id(1)
        item = tl.program_id(2)
        q_begin = tl.load(cu_ptr + item).to(tl.int32)
        q_len = tl.load(cu_ptr + item + 1).to(tl.int32) - q_begin
        row0 = tile * BLOCK_M
        if row0 < q_len:  # the grid covers the longest item; shorter ones' spare tiles do nothing
            start = tl.load(start_ptr + item).to(tl.int32)
            kvh = h // group
            r = row0 + tl.arange(0, BLOCK_M)  # [BM] rows of the item
            r_ok = r < q_len
            q_pos = start + r  # [BM] positions
            d = tl.arange(0, BLOCK_D)
            d_ok = d < head_dim
            q_rows = (q_begin + r).to(tl.int64) * q_stride_t + h * q_stride_h  # [BM]
            q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            # keys the tile can see: up to its last query, from the first query's window start
            hi = tl.minimum(start + row0 + BLOCK_M, start + q_len)
            lo = tl.full((), 0, tl.int32)
            if USE_WINDOW:
                lo = tl.maximum(start + row0 - window + 1, 0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
            for j0 in range(lo, hi, BLOCK_N):
                pos = j0 + tl.arange(0, BLOCK_N)  # [BN] key positions
                ok = pos < hi
                page = tl.load(table_ptr + item * table_stride + pos // page_size, mask=ok, other=0).to(tl.int64)
                row = (page * page_size + pos % page_size) * kv_stride_s + kvh * kv_stride_h  # [BN]
                kv_mask = ok[:, None] & d_ok[None, :]
                kt = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
                vt = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if FP8:  # through float32: the interpreter widens e5m2 subnormals to float16 wrongly
                    kt = kt.to(tl.float32).to(q_ptr.dtype.element_ty)
                    vt = vt.to(tl.float32).to(q_ptr.dtype.element_ty)
                if UPCAST:
                    kt = kt.to(tl.float32)
                    vt = vt.to(tl.float32)
                s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BM, BN], log2 units
                if USE_SOFTCAP:  # c tanh(s / c) in log2 units; tanh(y) = 1 - 2 / (e^2y + 1)
                    s = (1.0 - 2.0 / (tl.exp(s * (2.0 / softcap)) + 1.0)) * softcap
                seen = ok[None, :] & (pos[None, :] <= q_pos[:, None])  # [BM, BN]
                if USE_WINDOW:
                    seen = seen & (pos[None, :] > q_pos[:, None] - window)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
                pv = p.to(vt.dtype)
                if UPCAST:
                    pv = p.to(tl.bfloat16).to(tl.float32)  # the rounding a GPU's bf16 dot takes
                acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=PRECISION)
                m_i = m_new
            o = acc * kv_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_rows = ((q_begin + r).to(tl.int64) * num_heads + h) * head_dim  # out is [T, H, D] contiguous
            tl.store(out_ptr + out_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & d_ok[None, :])

    return extend
