"""Paged decode attention on the GPU (one query token per request), in Triton, and its torch
reference.

decode_attention(q [B, H, D], k, v [S, Hkv, D], page_table [B, P], kv_lens [B], page_size, scale)
→ [B, H, D] in q's dtype: request b's query attends over its kv_lens[b] keys at positions
0 .. kv_lens[b] - 1, position p living in slot page_table[b, p // page_size] * page_size +
p % page_size of the pool views (one layer's KVPool.k[layer], .v[layer]). Its own key, the last
one, is already written. Options: a sliding window W (keys at p >= kv_len - W only), a Gemma 2
soft-cap c (scores → c tanh(scores / c) before the mask and softmax).

GQA: one program takes a KV head and the H / Hkv query heads that share it, so each K/V row is
read once for the whole group; the group is padded to 16 rows (tl.dot's smallest side).

Split-K, two launches: the KV range of a request is cut into `num_splits` chunks, one program
each (B x Hkv x splits programs fill the GPU at small batch and long contexts); each writes its
float32 running max (log2 units), sum of exponentials and unnormalised accumulator, and a
reduce kernel rescales and sums them. With one split the first kernel normalises and writes
the output itself (one launch). The default split count comes from the batch, the KV heads
and the longest KV length (choose_num_splits), passed as a host int so launching never syncs;
a caller replaying a CUDA graph pins it with num_splits.

FP8 pools (float8_e4m3fn / float8_e5m2, kernels/kv_fp8.py): rows are widened to q's dtype in
the kernel and the per-format scale is folded into the score scale (K) and the output (V):
exact, the scales are powers of two. The Hadamard rotation of stored rows is the caller's
(rotate q before, the output after; services/worker/attention/triton_backend.py). fp8 is
widened through float32: Triton 3.9's interpreter turns e5m2 subnormals into wrong float16s.

Triton is imported on first use, as in grammar_bitmask.py; the reference needs only torch.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.kv_fp8 import FP8_KV_SCALES, widen_kv
from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK_N = 64  # keys per step of a program
MIN_SPLIT_TOKENS = 256  # the shortest chunk worth a program and a share of the reduce (a guess: not yet timed on a GPU)
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                     kv_lens: torch.Tensor, page_size: int, scale: float, *, window: int | None = None,
                     softcap: float | None = None, num_splits: int | None = None,
                     max_kv_len: int | None = None) -> torch.Tensor:
    """q [B, H, D] float32/bfloat16/float16 (rows and heads may be strided, the last dim
    contiguous); k, v [S, Hkv, D] of q's dtype or one FP8 dtype, equal strides, last dim
    contiguous; page_table [B, P] int32/int64 (last dim contiguous); kv_lens [B] int32/int64,
    each in [0, P page_size] (0: a zero output row). All on one CUDA device (CPU tensors only
    under TRITON_INTERPRET=1). num_splits: split-K chunks per request (None: choose_num_splits
    from max_kv_len, computed from kv_lens when not given, a device sync). → [B, H, D], q's dtype.
    Raises ValueError on a bad shape, stride, dtype, device or (CPU tensors) index; RuntimeError
    without triton."""
    triton = _triton()
    check_paged(q, k, v, page_table, kv_lens.shape, page_size, scale, window, softcap, what="kv_lens")
    if kv_lens.dim() != 1 or kv_lens.dtype not in INDEX_DTYPES or kv_lens.device != q.device:
        raise ValueError(f"kv_lens must be [B] int32/int64 on {q.device}, got {list(kv_lens.shape)} "
                         f"{kv_lens.dtype} on {kv_lens.device}")
    if q.shape[0] != kv_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} requests, kv_lens {kv_lens.shape[0]}: they must match")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if not q.is_cuda and not (q.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"q is on {q.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if q.device.type == "cpu":
        check_pages(page_table, kv_lens, page_size, k.shape[0], "kv_lens")
    B, H, D = q.shape
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    kv_lens = kv_lens.contiguous()
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    hkv = k.shape[1]
    splits = num_splits or choose_num_splits(B, hkv, max_kv_len, q.device)
    one = splits == 1
    m = l = acc = out  # stand-ins the one-split kernel never touches
    if not one:
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)  # log2-unit running max
        l = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)  # sum of 2^(s - m)
        acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)  # unnormalised sum p v
    interp = bool(triton.knobs.runtime.interpret)
    partial, reduce = _kernels(interp)
    upcast = interp and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (lora_sgmv.py)
    kv_scale = FP8_KV_SCALES.get(k.dtype, 1.0)
    group = H // hkv
    partial[(B, hkv, splits)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), page_table, page_table.stride(0), kv_lens,
        m, l, acc, out, H, group, D, page_size, scale * kv_scale * LOG2E, kv_scale, window or 0,
        (softcap or 1.0) * LOG2E, splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=_block_d(D),
        USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None, ONE_SPLIT=one,
        FP8=k.dtype in FP8_KV_SCALES, UPCAST=upcast, PRECISION=_precision(q.dtype, upcast))
    if not one:
        reduce[(B, H)](m, l, acc, out, out.stride(0), out.stride(1), H, D, splits,
                       BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=_block_d(D))
    return out


def choose_num_splits(batch: int, kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Split-K chunks per request: enough programs (batch x kv_heads x splits) for two per
    streaming multiprocessor, each chunk at least MIN_SPLIT_TOKENS keys, at most MAX_SPLITS."""
    # CPU tensors (the interpreter): sized as for an H100/H200's 132 SMs, so tests pick what that GPU would
    programs = 2 * _sm_count(device) if device.type == "cuda" else 264
    want = -(-programs // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_kv_len // MIN_SPLIT_TOKENS), MAX_SPLITS))


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                               kv_lens: torch.Tensor, page_size: int, scale: float, *, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """The same in float32 torch, one request at a time, on any device → [B, H, D] q's dtype."""
    check_paged(q, k, v, page_table, kv_lens.shape, page_size, scale, window, softcap, what="kv_lens")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(kv_lens.tolist()):
        if n:
            keys, values = paged_rows(k, v, page_table[b], n, page_size)
            out[b] = attend_reference(q[b:b + 1].float(), torch.tensor([n - 1]), keys, values, scale, window,
                                      softcap)[0]
    return out.to(q.dtype)


def paged_rows(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, n: int,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions 0 .. n - 1 of one request (its page-table row `pages` [P]) → K, V [n, Hkv, D]
    float32, FP8 rows widened times their scale (still rotated)."""
    pos = torch.arange(n, device=pages.device)
    slots = (pages.long()[pos // page_size] * page_size + pos % page_size).to(k.device)
    # gathered as bytes: torch has no float8 indexing on CPU
    rows = [(t.view(torch.uint8)[slots].view(t.dtype) if t.element_size() == 1 else t[slots]) for t in (k, v)]
    return widen_kv(rows[0], torch.float32), widen_kv(rows[1], torch.float32)


def attend_reference(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None, softcap: float | None) -> torch.Tensor:
    """q [n, H, D] float32 at positions q_pos [n] over keys k, v [L, Hkv, D] float32 at 0 .. L - 1,
    causal (and windowed) by position, soft-capped when given → [n, H, D] float32."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("nhd,lhd->hnl", q, kk) * scale  # [H, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key = torch.arange(k.shape[0], device=q.device)[None, :]
    qp = q_pos.to(q.device)[:, None]
    visible = (key <= qp) & ((key > qp - window) if window is not None else True)  # [n, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, vv)


def check_paged(q, k, v, page_table, lens_shape, page_size, scale, window, softcap, what) -> None:
    """The shapes, strides, dtypes and devices both attention kernels share (no device sync)."""
    if q.dim() != 3 or q.dtype not in DTYPES:
        raise ValueError(f"q must be [N, H, D] float32/bfloat16/float16, got {list(q.shape)} {q.dtype}")
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.stride() != v.stride():
        raise ValueError(f"k and v must be [S, Hkv, D] views of one dtype and layout, got {list(k.shape)} "
                         f"{k.dtype} {k.stride()} and {list(v.shape)} {v.dtype} {v.stride()}")
    if k.dtype != q.dtype and k.dtype not in FP8_KV_SCALES:
        raise ValueError(f"the pool's dtype {k.dtype} must be q's ({q.dtype}) or an FP8 one")
    H, D, hkv = q.shape[1], q.shape[2], k.shape[1]
    if k.shape[2] != D or hkv == 0 or H % hkv:
        raise ValueError(f"q has {H} heads of {D}, the pool {hkv} of {k.shape[2]}: head dims must match "
                         "and the query heads be a multiple of the KV heads")
    for name, t in (("q", q), ("k", k), ("page_table", page_table)):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if page_table.dim() != 2 or page_table.dtype not in INDEX_DTYPES:
        raise ValueError(f"page_table must be [B, P] int32/int64, got {list(page_table.shape)} {page_table.dtype}")
    if page_table.shape[0] != lens_shape[0]:
        raise ValueError(f"page_table has {page_table.shape[0]} rows, {what} {lens_shape[0]}: they must match")
    if page_size < 1 or k.shape[0] % page_size:
        raise ValueError(f"page_size must be >= 1 and divide the pool's {k.shape[0]} slots, got {page_size}")
    if not scale > 0 or (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError(f"scale and softcap must be > 0 and window >= 1, got {scale}, {softcap}, {window}")
    for name, t in (("k", k), ("v", v), ("page_table", page_table)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: move it first")


def check_pages(page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, slots: int, what: str) -> None:
    """The values, for CPU tensors (on a GPU this would cost a sync per call): each request's
    KV fits its page-table row and every page it reads is in the pool."""
    n = kv_lens.long()
    if n.numel() and (n.min() < 0 or n.max() > page_table.shape[1] * page_size):
        raise ValueError(f"{what} must be in [0, {page_table.shape[1] * page_size}] (the page table's "
                         f"{page_table.shape[1]} pages of {page_size}), got {n.tolist()}")
    used = torch.arange(page_table.shape[1])[None, :] < (n[:, None] + page_size - 1) // page_size  # [B, P]
    pages = page_table[used]
    if pages.numel() and (pages.min() < 0 or pages.max() >= slots // page_size):
        raise ValueError(f"page ids must be in [0, {slots // page_size}), got {pages.unique().tolist()[:8]}...")


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _precision(dtype: torch.dtype, upcast: bool) -> str:
    return "ieee" if dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for half inputs


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _triton() -> Any:
    return import_triton("paged decode attention", "decode_attention_reference")


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """(partial, reduce) jitted for this interpreter setting (kernels.triton.jitted)."""
    return jitted(interpret, _partial_source, _reduce_source)


def _partial_source(tl: Any) -> Any:
    def partial(q_ptr, q_stride_b, q_stride_h, k_ptr, v_ptr, kv_stride_s, kv_stride_h, table_ptr, table_stride,
                lens_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, num_heads, group, head_dim, page_size, qk_scale, kv_scale,
                window, softcap, num_splits, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, ONE_SPLIT: tl.constexpr,
                FP8: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (request, KV head, split): its group's scores over its chunk of keys, online
        softmax in float32 with log2-unit maxima (qk_scale carries log2 e and the K scale,
        softcap log2 e). tl.reduce with tl.standard's combine functions, not tl.max / tl.sum:
        those are jitted helpers the interpreter cannot call once triton was imported with it off."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(lens_ptr + b).to(tl.int32)
        lo = tl.full((), 0, tl.int32)
        if USE_WINDOW:
            lo = tl.maximum(kv_len - window, 0)
        chunk = (kv_len - lo + num_splits - 1) // num_splits
        begin = lo + split * chunk
        end = tl.minimum(begin + chunk, kv_len)
        hi = tl.arange(0, BLOCK_H)
        heads = kvh * group + hi  # [BH]
        h_ok = hi < group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, BD]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
        acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
        for start in range(begin, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BN] key positions
            ok = pos < end
            page = tl.load(table_ptr + b * table_stride + pos // page_size, mask=ok, other=0).to(tl.int64)
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
            s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BH, BN], log2 units
            if USE_SOFTCAP:  # c tanh(s / c) in log2 units (softcap = c log2 e); tanh(y) = 1 - 2 / (e^2y + 1)
                s = (1.0 - 2.0 / (tl.exp(s * (2.0 / softcap)) + 1.0)) * softcap
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))  # finite: every step has a valid key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            pv = p.to(vt.dtype)
            if UPCAST:
                pv = p.to(tl.bfloat16).to(tl.float32)  # the rounding a GPU's bf16 dot takes
            acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=PRECISION)
            m_i = m_new
        acc = acc * kv_scale
        if ONE_SPLIT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            row = (b * num_heads + heads).to(tl.int64)  # out is [B, H, D] contiguous
            tl.store(out_ptr + row[:, None] * head_dim + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & d_ok[None, :])
        else:
            part = (b * num_heads + heads) * num_splits + split  # [BH]: (b, h, split) in m, l, acc
            tl.store(m_ptr + part, m_i, mask=h_ok)
            tl.store(l_ptr + part, l_i, mask=h_ok)
            tl.store(acc_ptr + part.to(tl.int64)[:, None] * head_dim + d[None, :], acc,
                     mask=h_ok[:, None] & d_ok[None, :])

    return partial


def _reduce_source(tl: Any) -> Any:
    def reduce(m_ptr, l_ptr, acc_ptr, out_ptr, out_stride_b, out_stride_h, num_heads, head_dim, num_splits,
               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (request, head): the splits' partial sums rescaled to their common max, summed,
        normalised. Empty splits (max -inf) weigh 0; a zero-length request writes zeros."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        s_ok = sp < num_splits
        part = (b * num_heads + h) * num_splits + sp  # [BS]
        m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + part, mask=s_ok, other=0.0)
        top = tl.reduce(m, 0, tl.standard._elementwise_max)
        w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))  # [BS]
        total = tl.reduce(l * w, 0, tl.standard._sum_combine)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        acc = tl.load(acc_ptr + part.to(tl.int64)[:, None] * head_dim + d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BS, BD]
        o = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * out_stride_b + h * out_stride_h + d, o.to(out_ptr.dtype.element_ty),
                 mask=d_ok)

    return reduce
