"""Paged decode attention on CPU: a C++ kernel built on first use, and its torch reference.

The kernel reads each request's K and V once, in place, through its slot
table; the reference gathers them and calls SDPA. `load()` returns None when
the kernel cannot be built here (no compiler), and callers fall back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_build import load_cpu_extension
from kernels.kv_fp8 import dequantize_kv


def load():
    """The compiled extension, or None if it cannot be built (logged once)."""
    return load_cpu_extension("paged_decode_cpu", "paged_decode_attention.cpp")


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                           kv_lens: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None,
                           new_slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; k, v [S, Hkv, D] (the model's dtype, or FP8: kernels/kv_fp8.py's scale applies);
    slots [B, L] int64; kv_lens [B] → [B, H, D] in q's dtype. With k_new, v_new [B, Hkv, D] and
    new_slots [B], those rows are written to the pool first: in the pool's dtype, or for an FP8
    pool also a float dtype (rotated and rounded in the kernel, as kv_fp8.quantize_kv does)."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged decode kernel is not built")
    return module.paged_decode_attention(q, k, v, slots.contiguous(), kv_lens, scale, k_new, v_new, new_slots)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same contract in plain torch (float32 math): gather, widen (FP8: times its scale), mask, SDPA."""
    B, L = slots.shape
    kg = dequantize_kv(k[slots], torch.float32).transpose(1, 2)  # [B, Hkv, L, D]
    vg = dequantize_kv(v[slots], torch.float32).transpose(1, 2)
    mask = (torch.arange(L)[None, :] < kv_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), kg, vg, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2).to(q.dtype)
