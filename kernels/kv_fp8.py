"""FP8 KV elements in torch: the scales, the rotation, the write rounding and the widening
that the C++ kernels (kernels/cpu/fp8.h) match; the references and the torch attention
path use these.

A stored FP8 row is fp8(H x / scale): each head's row x [D] is first rotated by the
orthonormal Walsh-Hadamard matrix H (Sylvester order, blocks of the largest power of two
dividing D), then rounded. H is symmetric and its own inverse, so a reader widens, scales
and rotates back with the same H; attention kernels instead rotate the query once
(q.k = Hq.Hk) and the output once (sum p Hv = H sum p v). Why: this model's K and V have a
few outlier channels that the query also weighs heavily, so rounding error on them lands
in every score; spread over all D channels by H it mostly cancels
(docs/quantization.md, "FP8 KV cache", has the measurement: e4m3 +2.8% -> +0.3%).

The scale is one per format, the same for every layer, K and V: a power of two, so scaling
is exact.
"""
from __future__ import annotations

import math

import torch

FP8_KV_SCALES: dict[torch.dtype, float] = {torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 1.0}
# Part of a page's identity (services/kvstore/page_codec.py): how its bytes were made.
FP8_KV_ROTATION = "hadamard"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_SCALES


def hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim (64 → 64, 96 → 32)."""
    return head_dim & -head_dim


def hadamard_rotate(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """x [..., D] float32 → H x per block of hadamard_block(D), or of `block` (a power of two
    dividing D: an MLA latent pool's V columns rotate in the blocks of its whole K row)
    (orthonormal, self-inverse).
    Butterflies in the order fp8.h's hadamard_inplace runs them, so both round alike; and
    element-wise, so a row's result never depends on the other rows (a matmul's can: its
    summation blocking follows the row count, which would break batch invariance)."""
    d = x.shape[-1]
    n = block or hadamard_block(d)
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)  # [rows, blocks, (a, b), h]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return (y * hadamard_norm(n)).view(x.shape)


def hadamard_norm(n: int) -> float:
    """1 / sqrt(n) computed in double, rounded to float32 (fp8.h's norm; exact for 64: 1/8)."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] to store in a pool of `dtype`: x converted, or for FP8 H x / scale
    rounded by torch's float -> float8 conversion (e4m3 saturates at +-448; the C++ write
    path stores the same bytes)."""
    scale = FP8_KV_SCALES.get(dtype)
    if scale is None:
        return x.to(dtype)
    return (hadamard_rotate(x.float()) * (1.0 / scale)).to(dtype)


def widen_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows → `dtype`, FP8 ones times the scale but still rotated (H x): what attention
    reads when it rotates the query and its output instead of every row (exact: powers of two)."""
    scale = FP8_KV_SCALES.get(x.dtype)
    out = x.to(dtype)
    return out if scale is None or scale == 1.0 else out.mul_(scale)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., D] → values in `dtype` (FP8: widened, times the scale, rotated back)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return hadamard_rotate(widen_kv(x, torch.float32)).to(dtype)
