"""A W8A16 GEMM on the GPU: activations times FP8 E4M3 weights with one scale per output row, and
its torch reference.

fp8_linear(x, w, scale, bias): y [M, N] = x [M, K] @ (w [N, K] * scale[N, None]).T (+ bias),
x float32/bfloat16/float16, w float8_e4m3fn, scale float32. One program per tile of BLOCK_M rows
x BLOCK_N output columns walks K in steps of BLOCK_K: it loads the weight tile's bytes, widens
them in registers to x's dtype, multiplies on tensor cores with float32 sums, and applies the
row scales (and the bias) once, at the end, before the one rounding into y. Any M: decode steps
(M = 1..64) take 16-row tiles, prefill larger ones (block_config).

The widening is integer arithmetic on the bytes, not a float8 conversion, so one code path runs
under Triton's interpreter (numpy has no float8) and on any CUDA GPU (hardware float8
conversions need sm_89+). An e4m3fn byte s eeee mmm is moved into a float16's bits as
s 0eeee mmm0000000: the same exponent and mantissa under float16's larger bias (15 against 7),
which reads as the e4m3 value times 2^-8 exactly, subnormals included (an e4m3 subnormal lands
on a float16 subnormal with the same ratio). The 2^8 is folded into the scale. The two NaN
bytes (0x7F, 0xFF) would read as +-480: the quantizer never writes them (it clamps to +-448).
From float16 the value goes to x's dtype exactly (3 mantissa bits fit bfloat16, and 2^-17 and
up are bfloat16 normals).

The reference, fp8_linear_reference, widens with torch's own float8 conversion and computes in
float32 on any device.

Triton is imported on first use, as in grammar_bitmask.py: services import this module without
launching it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E4M3 = torch.float8_e4m3fn
BITS_SCALE = 256.0  # the float16 reading of an e4m3 byte is its value / 2^8


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings for one GEMM (num_warps/num_stages matter only on a GPU)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_config(m: int) -> BlockConfig:
    """Tiles by row count. Decode (few rows) reads the weight once and is bound by its bytes:
    16-row tiles (tl.dot's smallest), long K steps, narrow N tiles so even a small N gives
    many programs. Prefill is bound by math: wider tiles reuse each loaded weight byte more."""
    if m <= 16:
        return BlockConfig(16, 64, 128, 4, 4)
    if m <= 64:
        return BlockConfig(64, 64, 128, 4, 3)
    return BlockConfig(64, 128, 64, 8, 3)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = False) -> torch.Tensor:
    """x [M, K] float32/bfloat16/float16 (rows may be strided, the last dim contiguous), w [N, K]
    float8_e4m3fn contiguous, scale [N] float32 contiguous, bias [N] of a float dtype or None, all
    on one CUDA device (CPU tensors only under TRITON_INTERPRET=1) → y [M, N] in x's dtype
    (float32 when float_out), a new tensor: x @ (w * scale[:, None]).T + bias, float32 sums.
    Raises ValueError on a bad shape, stride, dtype or device; RuntimeError without triton."""
    triton = _triton()
    _check(x, w, scale, bias)
    if not x.is_cuda and not (x.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"x is on {x.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32 if float_out else x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    if k == 0:  # an empty sum: only the bias
        return y.zero_() if bias is None else y.copy_(bias.float().expand(m, n))
    interpret = bool(triton.knobs.runtime.interpret)
    # triton 3.9's interpreter multiplies bfloat16 blocks as their int16 bits (lora_sgmv.py): there
    # both sides go to float32 first (exact products, the same float32 sums); on a GPU they stay.
    upcast = interpret and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for half inputs
    cfg = block_config(m)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _kernel(interpret)[grid](
        x, x.stride(0), w.view(torch.uint8), scale, y if bias is None else bias, y, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=precision, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                         float_out: bool = False) -> torch.Tensor:
    """The same contract in float32 torch on any device (torch's float8 widening, the scale on
    the weight): the numbers the kernel must match within its float32 rounding."""
    _check(x, w, scale, bias)
    y = x.float() @ (w.float() * scale[:, None]).t()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y if float_out else y.to(x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, strides, dtypes and devices, as ValueErrors a caller can act on (no device sync)."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [M, K] float32/bfloat16/float16, got {list(x.shape)} {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x needs a contiguous last dim, got strides {x.stride()}")
    if w.dim() != 2 or w.dtype != E4M3:
        raise ValueError(f"w must be [N, K] float8_e4m3fn, got {list(w.shape)} {w.dtype}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} columns, w {w.shape[1]}: they must match")
    if scale.dim() != 1 or scale.shape[0] != w.shape[0] or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [N = {w.shape[0]}], got {list(scale.shape)} {scale.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0] or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [N = {w.shape[0]}], got {list(bias.shape)} {bias.dtype}")
    named = [("w", w), ("scale", scale)] + ([] if bias is None else [("bias", bias)])
    for name, t in named:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: move it first")


def _triton() -> Any:
    return import_triton("FP8 GEMM", "fp8_linear_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _source)[0]


def _source(tl: Any) -> Any:
    def fp8_gemm(x_ptr, x_stride, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
        """y[rows, cols] = x[rows] @ (w[cols] * s[cols]).T (+ b[cols]) for one BLOCK_M x BLOCK_N tile."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = rows < M
        col_ok = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride  # [BM, 1]
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # [1, BN]: W^T[k, n] sits at w[n, k]
        # tl.full, not tl.zeros: a jitted helper the interpreter does not patch when tl is a closure
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = k < K
            xt = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            wb = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)  # uint8 [BK, BN]
            # e4m3 byte s eeee mmm → float16 bits s 0eeee mmm0000000 (the module docstring)
            wi = wb.to(tl.int32)
            bits = ((wi & 0x80) << 8) | ((wi & 0x7F) << 7)
            wt = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(xt.dtype)  # [BK, BN] value / 2^8
            if UPCAST:
                xt, wt = xt.to(tl.float32), wt.to(tl.float32)
            acc += tl.dot(xt, wt, input_precision=PRECISION)
        s = tl.load(s_ptr + cols, mask=col_ok, other=0.0) * 256.0  # [BN]: BITS_SCALE folded in
        out = acc * s[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    return fp8_gemm
