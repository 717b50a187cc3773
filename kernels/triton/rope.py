"""Rotary position embeddings on the GPU: q and k heads of a packed qkv rotated in place, with
the LayerOps.rope_qk contract (services/worker/model/layer_ops.py), and the torch reference.

rope_qk_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim): qkv [T, (H + 2 Hkv) D]
holds each token's H q heads, Hkv k heads, Hkv v heads. The first H + Hkv heads of row t are
rotated by the table rows cos[positions[t]], sin[positions[t]] ([P, D] float32, rotate-half
layout, as services/worker/model/rope.py builds them, Llama-3 scaling already in the table):
for i < D/2, (x1, x2) = (x[i], x[i + D/2]) becomes (x1 cos[i] - x2 sin[i], x2 cos[i + D/2] +
x1 sin[i + D/2]), in float32, rounded to qkv's dtype once (the fused CPU kernel's math). The v
heads and any columns past them are not touched.

Positions are trusted on a CUDA device (checking them would cost a device sync per layer); on
CPU tensors (the interpreter) they are checked against the table. One program per token and
block of heads. Under the interpreter bfloat16 results are rounded by their bits (rms_norm.py
says why). Triton is imported on first use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEMENTS = 1024  # (head, i < D/2) pairs per program


def rope_qk_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, W >= (H + 2 Hkv) D] float32/bfloat16/float16 (rows may be strided, the last dim
    contiguous), positions [T] int64/int32, cos and sin [P, D] float32 (rows may be strided,
    the last dim contiguous), D even. Rotates the q and k heads in place and returns qkv. On a
    CUDA device (CPU tensors only under TRITON_INTERPRET=1). Raises ValueError on a bad shape,
    stride, dtype, device or (CPU) position; RuntimeError without triton."""
    triton = _triton()
    _check(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)
    if not qkv.is_cuda and not (qkv.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"qkv is on {qkv.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    T, heads = qkv.shape[0], num_heads + num_kv_heads
    if qkv.device.type == "cpu" and T and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the rope table), "
                         f"got {positions.min()}..{positions.max()}")
    if T == 0 or heads == 0:
        return qkv
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_heads = min(triton.next_power_of_2(heads), max(1, _ELEMENTS // block_half))
    _kernel(triton.knobs.runtime.interpret)[(T, triton.cdiv(heads, block_heads))](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), sin.stride(0), heads, half,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
        ROUND_BF16=bool(triton.knobs.runtime.interpret) and qkv.dtype == torch.bfloat16)
    return qkv


def rope_qk_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The same in torch, on any device, out of place: a new tensor, qkv untouched."""
    _check(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)
    T, heads, half = qkv.shape[0], num_heads + num_kv_heads, head_dim // 2
    out = qkv.clone()
    x = qkv[:, :heads * head_dim].float().view(T, heads, head_dim)  # [T, H + Hkv, D]
    c = cos[positions.long()].unsqueeze(1)  # [T, 1, D]
    s = sin[positions.long()].unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]], -1)
    out[:, :heads * head_dim] = rotated.reshape(T, -1).to(qkv.dtype)
    return out


def _check(qkv, positions, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """The contract both paths share, as ValueErrors a caller can act on (no device sync)."""
    if qkv.dim() != 2 or qkv.dtype not in DTYPES:
        raise ValueError(f"qkv must be [T, W] float32/bfloat16/float16, got {list(qkv.shape)} {qkv.dtype}")
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        raise ValueError(f"qkv needs a contiguous last dim, got strides {qkv.stride()}")
    if num_heads < 0 or num_kv_heads < 0 or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"need heads >= 0 and an even head_dim > 0, got {num_heads}, {num_kv_heads}, {head_dim}")
    if qkv.shape[1] < (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv rows of {qkv.shape[1]} cannot hold (H + 2 Hkv) D = "
                         f"({num_heads} + 2 x {num_kv_heads}) x {head_dim}")
    if positions.dim() != 1 or positions.shape[0] != qkv.shape[0] or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be [T = {qkv.shape[0]}] int64/int32, got "
                         f"{list(positions.shape)} {positions.dtype}")
    if positions.shape[0] > 1 and positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.dtype != torch.float32 or t.shape[1] != head_dim:
            raise ValueError(f"{name} must be [P, D = {head_dim}] float32, got {list(t.shape)} {t.dtype}")
        if t.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin {list(sin.shape)} and cos {list(cos.shape)} must match")
    for name, t in (("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}: move it first")


def _triton() -> Any:
    return import_triton("RoPE", "rope_qk_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _rope_source)[0]


def _rope_source(tl: Any) -> Any:
    def rope(qkv_ptr, row_stride, pos_ptr, cos_ptr, sin_ptr, cos_stride, sin_stride, n_heads, half,
             BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND_BF16: tl.constexpr):
        """Token program_id(0), heads [program_id(1) BH, +BH) of the H + Hkv rotated ones."""
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
        i = tl.arange(0, BLOCK_HALF)  # [BHALF]
        i_ok = i < half
        ok = (head < n_heads)[:, None] & i_ok[None, :]
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * cos_stride + i, mask=i_ok, other=0.0)[None, :]  # [1, BHALF]
        c2 = tl.load(cos_ptr + pos * cos_stride + half + i, mask=i_ok, other=0.0)[None, :]
        s1 = tl.load(sin_ptr + pos * sin_stride + i, mask=i_ok, other=0.0)[None, :]
        s2 = tl.load(sin_ptr + pos * sin_stride + half + i, mask=i_ok, other=0.0)[None, :]
        first = qkv_ptr + t * row_stride + head[:, None] * (2 * half) + i[None, :]  # [BH, BHALF]
        x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=ok, other=0.0).to(tl.float32)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
        if ROUND_BF16:  # round to nearest even by the bits (the interpreter's cast truncates)
            b1, b2 = y1.to(tl.int32, bitcast=True), y2.to(tl.int32, bitcast=True)
            b1 = tl.where((b1 & 0x7FFFFFFF) > 0x7F800000, b1 | 0x400000, b1 + 0x7FFF + ((b1 >> 16) & 1))
            b2 = tl.where((b2 & 0x7FFFFFFF) > 0x7F800000, b2 | 0x400000, b2 + 0x7FFF + ((b2 >> 16) & 1))
            tl.store(first, (b1 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=ok)
            tl.store(first + half, (b2 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=ok)
        else:
            tl.store(first, y1.to(qkv_ptr.dtype.element_ty), mask=ok)
            tl.store(first + half, y2.to(qkv_ptr.dtype.element_ty), mask=ok)

    return rope
