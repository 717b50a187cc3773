"""Numpy quantizers for the GGML k-quants Q4_K, Q5_K and Q6_K (the `gguf` package only dequantizes
them). Each writes ggml's exact block layout, so `gguf.quants.dequantize` reads the bytes back.

Layouts (a super-block of QK_K = 256 values):
- Q4_K, 144 bytes: d (f16), dmin (f16), 12 bytes of eight 6-bit scales and eight 6-bit mins,
  128 bytes of 4-bit q. Sub-block j (32 values): x = d * sc[j] * q - dmin * m[j].
- Q5_K, 176 bytes: as Q4_K, plus 32 bytes holding each value's fifth bit (bit j of byte l is
  sub-block j's value l) between the scales and the low nibbles; q in 0..31.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d (f16).
  Sub-block i (16 values): x = d * sc[i] * (q - 32), q in 0..63.

The scale search: Q4_K/Q5_K try 21 scales across each sub-block's min/max range, assign integers at
each, refit scale and min by least squares and keep the fit of least squared error (llama.cpp's
make_qkx2_quants searches similarly, with weights); Q6_K takes the signed absmax (mapped to -32)
and one least-squares refit. The sub-block scales (and mins) are then quantized to 6 (Q6_K: 8) bits
against the super-block's f16 d (and dmin).
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    out = np.zeros(np.broadcast(a, b).shape, dtype=np.float32)
    np.divide(a, b, out=out, where=b != 0)
    return out


def _refit(x: np.ndarray, q: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares (a >= 0, b >= 0) of x ≈ a q - b per sub-block for fixed integers q [n, S, 32];
    (a, b) kept where the fit degenerates."""
    n = x.shape[-1]
    sq, sx, sqq, sqx = q.sum(-1), x.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
    det = n * sqq - sq * sq
    a_ls = _div(n * sqx - sq * sx, det)
    b_ls = _div(sq * sqx - sqq * sx, det)
    a_zero = _div(sqx, sqq)  # the fit with b = 0, for sub-blocks whose fitted min would be < 0
    ok = (det > 0) & (a_ls > 0)
    return np.where(ok, np.where(b_ls >= 0, a_ls, a_zero), a), np.where(ok, np.maximum(b_ls, 0.0), b)


def _affine_fit(x: np.ndarray, nmax: int, steps: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """x [n, S, 32] → per sub-block (scale a >= 0, min b >= 0) [n, S] with x ≈ a * q - b, q in 0..nmax:
    over the min/max range (min clamped to <= 0, as ggml does), integers assigned at 2 * steps + 1
    trial scales (range / (nmax + k / steps), k in -steps..steps), each refit by least squares; the
    fit with the smallest squared error wins."""
    lo = np.minimum(x.min(-1), 0.0)
    span = x.max(-1) - lo
    best_a, best_b = span / nmax, -lo
    best_err = np.full(span.shape, np.inf, dtype=np.float32)
    for k in range(-steps, steps + 1):
        a0 = span / (nmax + k / steps)
        q = np.clip(np.rint(_div(x - lo[..., None], a0[..., None])), 0, nmax)
        a, b = _refit(x, q, a0, -lo)
        q = np.clip(np.rint(_div(x + b[..., None], a[..., None])), 0, nmax)  # requantize on the refit
        err = ((a[..., None] * q - b[..., None] - x) ** 2).sum(-1)
        better = err < best_err
        best_a, best_b, best_err = np.where(better, a, best_a), np.where(better, b, best_b), np.where(better, err, best_err)
    return best_a.astype(np.float32), best_b.astype(np.float32)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] → ggml's 12-byte packing [n, 12] (get_scale_min's inverse)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _k_affine(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """blocks [n, 256] → (d f16 [n], dmin f16 [n], scales uint8 [n, 8], mins uint8 [n, 8], q uint8 [n, 8, 32])."""
    x = blocks.reshape(-1, 8, 32).astype(np.float32)
    a, b = _affine_fit(x, nmax)  # [n, 8]
    d, dmin = _f16(a.max(-1) / 63), _f16(b.max(-1) / 63)
    sc = np.clip(np.rint(_div(a, d.astype(np.float32)[:, None])), 0, 63)
    m = np.clip(np.rint(_div(b, dmin.astype(np.float32)[:, None])), 0, 63)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]  # [n, 8, 1]
    off = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint(_div(x + off, step)), 0, nmax).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [n, 256] → Q4_K blocks uint8 [n, 144]."""
    d, dmin, sc, m, q = _k_affine(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # byte g*32+l: sub-blocks 2g (low), 2g+1 (high)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales_mins(sc, m), qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [n, 256] → Q5_K blocks uint8 [n, 176]."""
    d, dmin, sc, m, q = _k_affine(blocks, 31)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    bits = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]  # [n, 8, 32]
    qh = np.bitwise_or.reduce(bits, axis=1)  # [n, 32]: bit j of byte l = sub-block j's value l
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales_mins(sc, m), qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [n, 256] → Q6_K blocks uint8 [n, 210]."""
    x = blocks.reshape(-1, 16, 16).astype(np.float32)
    idx = np.abs(x).argmax(-1)[..., None]
    vmax = np.take_along_axis(x, idx, -1)[..., 0]  # the signed value of largest magnitude [n, 16]
    scale = -vmax / 32  # it maps to q - 32 = -32 exactly
    q = np.clip(np.rint(_div(x, scale[..., None])), -32, 31)
    # Least-squares refit of each sub-block's scale on its integers, then quantize it to int8 against d.
    scale = np.where((q * q).sum(-1) > 0, _div((q * x).sum(-1), (q * q).sum(-1)), scale)
    d = _f16(np.abs(scale).max(-1) / 127)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), -128, 127)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_div(x, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    hi = q >> 4  # [n, 2, 128]: element t*32+l's pair goes to bits 2t of byte l
    qh = hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(-1, 2)], axis=1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize_rows(rows: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) → blocks uint8 [N, K / 256 * type_size]."""
    n, k = rows.shape
    if k % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} values, got {k}")
    blocks = QUANTIZERS[qtype](np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK_K))
    return blocks.reshape(n, -1)
