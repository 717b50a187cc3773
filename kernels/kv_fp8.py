"""FP8 KV elements in torch: the scales, the write rounding and the widening that the C++
kernels (kernels/cpu/fp8.h) match; the references and the torch attention path use these.

A stored element means fp8_value * scale. One scale per format, the same for every layer,
K and V (docs/quantization.md, "FP8 KV cache", has the measurement that chose it): powers
of two, so scaling is exact. e4m3 at 1/4: values down to 2^-8 stay normal and |x| up to 112
fits (SmolLM2's largest |K| is ~24); e5m2's 5-bit exponent needs none.
"""
from __future__ import annotations

import torch

FP8_KV_SCALES: dict[torch.dtype, float] = {torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 1.0}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_SCALES


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows to store in a pool of `dtype`: x converted, or for FP8 x / scale rounded by torch's
    float -> float8 conversion (e4m3 saturates at +-448; the C++ write path stores the same bytes)."""
    scale = FP8_KV_SCALES.get(dtype)
    if scale is None:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows → values in `dtype` (FP8: widened, then times the scale; exact)."""
    scale = FP8_KV_SCALES.get(x.dtype)
    out = x.to(dtype)
    return out if scale is None or scale == 1.0 else out.mul_(scale)
