"""MLA decode attention on CPU (DeepSeek-V2/V3's absorbed form): a C++ kernel built on first
use, and its torch reference.

A pool layer holds one latent row of Dk = kv_lora_rank + qk_rope_head_dim elements per token;
every query head scores all Dk columns of a row and takes its first v_dim (= kv_lora_rank)
columns as the value. The kernel reads each request's rows once per block of heads, in place,
through its slot table; the reference gathers them. FP8 rows are read as stored value times
kernels/kv_fp8.py's scale: their Hadamard rotation is the caller's (rotate q before, the output
after). `load()` returns None when the kernel cannot be built here (no compiler).
"""
from __future__ import annotations

import torch

from kernels.cpu_build import load_cpu_extension
from kernels.kv_fp8 import widen_kv


def load():
    """The compiled extension, or None if it cannot be built (logged once)."""
    return load_cpu_extension("mla_decode_cpu", "mla_decode_attention.cpp")


def mla_decode_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float, v_dim: int) -> torch.Tensor:
    """q [B, H, Dk] float32/bfloat16/float16 (rows may be strided, heads contiguous); kv [S, 1, Dk]
    one pool layer (float32/bfloat16/float16 or FP8, any of them whatever q's dtype); slots [B, L]
    int64, positions past kv_lens never read; kv_lens [B] int64 in [0, L] → [B, H, v_dim] in q's
    dtype: softmax(scale q·row) over the request's rows, times rows[:, :v_dim]. A request with no
    keys (kv_lens 0) gets zeros. RuntimeError on a bad shape, dtype, length or slot, or when the
    kernel is not built."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU MLA decode kernel is not built")
    return module.mla_decode_attention(q, kv, slots.contiguous(), kv_lens.contiguous(), scale, v_dim)


def reference(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, scale: float,
              v_dim: int) -> torch.Tensor:
    """The same contract in plain torch (float32 math): gather, widen (FP8: times its scale, still
    rotated, as the kernel reads it), mask, softmax, weighted sum of the first v_dim columns."""
    if q.dim() != 3 or kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [B, H, Dk] and kv [S, 1, Dk], got {list(q.shape)} and {list(kv.shape)}")
    if not 1 <= v_dim <= q.shape[2]:
        raise ValueError(f"v_dim must be in [1, {q.shape[2]}], got {v_dim}")
    B, L = slots.shape
    valid = torch.arange(L)[None, :] < kv_lens[:, None]  # [B, L]
    rows = kv[:, 0]
    if rows.element_size() == 1:  # gathered as bytes: float8 indexing is not on every torch's CPU
        rows = rows.view(torch.uint8)[torch.where(valid, slots, 0)].view(kv.dtype)
    else:
        rows = rows[torch.where(valid, slots, 0)]
    rows = widen_kv(rows, torch.float32)  # [B, L, Dk]
    scores = torch.einsum("bhd,bld->bhl", q.float(), rows) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    probs = probs.nan_to_num(0.0)  # a request with no keys: zeros, as the kernel writes
    return torch.einsum("bhl,bld->bhd", probs, rows[..., :v_dim]).to(q.dtype)
