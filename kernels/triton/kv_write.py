"""This step's K and V rows written into one layer of the paged KV pool on the GPU, in the pool's
dtype, and the torch reference beside it.

write_kv_(k_cache, v_cache, k, v, slots): k_cache[slots[t]] = quantize_kv(k[t], pool dtype), and
the same for v. A model-dtype pool (float32/bfloat16/float16) stores each element converted
(round to nearest even). An FP8 pool stores fp8(H x / scale) as kernels/kv_fp8.py defines it:
each head's row rotated by the orthonormal Sylvester Walsh-Hadamard H over blocks of
hadamard_block(D), divided by the format's power-of-two scale, rounded as torch rounds float32
to float8. The bytes equal quantize_kv's (and the C++ write's) exactly; the tests check them.

Two choices made so that the bytes are exact, on a GPU and under the interpreter alike:
- The rotation runs in the kernel as the butterflies hadamard_rotate runs (log2(n) stages of
  one add or subtract per element, in the same pairing: reshape, split, join), then the 1/sqrt(n)
  multiply. A tl.dot with H would sum each output's n products in another order (and in tf32 on
  tensor cores), so its rounding would differ from the reference's, and would need an M >= 16
  tile and H in memory; rotating outside the kernel would cost a float32 copy of k and v and a
  dozen small launches a layer. The butterflies are register shuffles on a row the kernel holds.
- The float8 bytes are made with integer arithmetic on the float32 bits, stored through a uint8
  view of the pool. Triton's own casts differ from torch at the edges: the interpreter turns
  500.0 into e4m3 0x78 (256), and the GPU's cvt.rn.satfinite saturates e5m2 where torch gives
  inf. Torch 2.13's conversion, which this matches: round to nearest even, subnormals included;
  e4m3fn saturates every finite or infinite magnitude past 448 to +-448 (0x7E) and maps NaN to
  0x7F; e5m2 rounds past 57344 to inf (0x7C) and maps NaN to 0x7F; the sign bit kept in all cases.

Slots are trusted on a CUDA device (checking them would cost a device sync per layer); on CPU
tensors (the interpreter) they are range-checked. With a slot repeated, which token's row lands
there is unspecified, as with index_copy_. A bfloat16 pool written from float32 or float16 rows is
rounded by the bits under the interpreter (rms_norm.py says why). Triton is imported on first
use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.kv_fp8 import FP8_KV_SCALES, hadamard_block, hadamard_norm, quantize_kv
from kernels.triton import import_triton, jitted

SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POOL_DTYPES = SOURCE_DTYPES + tuple(FP8_KV_SCALES)
# (mantissa bits, exponent bias, largest code a finite input may round to) per FP8 format
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 0x7E), torch.float8_e5m2: (2, 15, 0x7C)}
_ELEMENTS = 2048  # elements per program: rows of D, a power of two >= D


def write_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
    """k_cache, v_cache [S, Hkv, D]: one layer's pool views, contiguous, one dtype (float32,
    bfloat16, float16, float8_e4m3fn or float8_e5m2); k, v [T, Hkv, D] float32/bfloat16/float16,
    one dtype (rows and heads may be strided, the last dim contiguous); slots [T] int64/int32.
    Writes row t of k and v to slot slots[t] in the pool's dtype (FP8: rotated and scaled, see
    the module docstring), in place. All on one CUDA device (CPU tensors only under
    TRITON_INTERPRET=1). Raises ValueError on a bad shape, stride, dtype, device or (CPU) slot;
    RuntimeError without triton."""
    triton = _triton()
    _check(k_cache, v_cache, k, v, slots)
    if not k.is_cuda and not (k.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"k is on {k.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    T, n_heads, head_dim = k.shape
    if k.device.type == "cpu" and T and (slots.min() < 0 or slots.max() >= k_cache.shape[0]):
        raise ValueError(f"slots must lie in [0, {k_cache.shape[0]}), got {slots.min()}..{slots.max()}")
    if T == 0 or n_heads == 0 or head_dim == 0:
        return
    fp8 = _FP8_FORMATS.get(k_cache.dtype)
    mbits, bias, max_code = fp8 or (0, 0, 0)
    inv_scale = 1.0 / FP8_KV_SCALES.get(k_cache.dtype, 1.0)  # a power of two: exact
    n = hadamard_block(head_dim)
    round_bf16 = bool(triton.knobs.runtime.interpret) and k_cache.dtype == torch.bfloat16 and k.dtype != torch.bfloat16
    if fp8 is not None:  # the bytes, through a uint8 view: see the module docstring
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, _ELEMENTS // block_d)
    rows = T * n_heads
    _kernel(triton.knobs.runtime.interpret)[(triton.cdiv(rows, block_r), 2)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache, v_cache, k_cache.stride(0),
        slots, rows, n_heads, head_dim,
        BLOCK_R=block_r, BLOCK_D=block_d, FP8=fp8 is not None, HAD_LOG=n.bit_length() - 1,
        NORM=hadamard_norm(n), INV_SCALE=inv_scale, MBITS=mbits, BIAS=bias, MAX_CODE=max_code,
        ROUND_BF16=round_bf16)


def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """The same in torch, on any device: quantize_kv's rows copied in (torch has no float8
    index_copy_ on CPU, so one-byte pools copy as their bytes)."""
    _check(k_cache, v_cache, k, v, slots)
    index = slots.to(torch.int64)
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = quantize_kv(x, cache.dtype)  # [T, Hkv, D] in the pool's dtype
        if cache.element_size() == 1:
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.index_copy_(0, index, rows)


def _check(k_cache, v_cache, k, v, slots) -> None:
    """The contract both paths share, as ValueErrors a caller can act on (no device sync)."""
    if k_cache.dim() != 3 or k_cache.dtype not in POOL_DTYPES:
        raise ValueError(f"k_cache must be [S, Hkv, D] of a pool dtype (float32/bfloat16/float16/"
                         f"float8_e4m3fn/float8_e5m2), got {list(k_cache.shape)} {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {list(v_cache.shape)} {v_cache.dtype} must match k_cache "
                         f"{list(k_cache.shape)} {k_cache.dtype}")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous (one layer's pool views)")
    if k.dim() != 3 or k.dtype not in SOURCE_DTYPES or v.dtype != k.dtype or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, Hkv, D] of one dtype (float32/bfloat16/float16), "
                         f"got {list(k.shape)} {k.dtype} and {list(v.shape)} {v.dtype}")
    if k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"k rows are {list(k.shape[1:])} (Hkv, D), the pool's {list(k_cache.shape[1:])}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if slots.dim() != 1 or slots.shape[0] != k.shape[0] or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be [T = {k.shape[0]}] int64/int32, got {list(slots.shape)} {slots.dtype}")
    if slots.shape[0] > 1 and slots.stride(0) != 1:
        raise ValueError("slots must be contiguous")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}: move it first")


def _triton() -> Any:
    return import_triton("KV-cache write", "write_kv_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _write_source)[0]


def _write_source(tl: Any) -> Any:
    def write_kv(k_ptr, v_ptr, k_s0, k_s1, v_s0, v_s1, kc_ptr, vc_ptr, c_s0, slots_ptr, n_rows, n_heads, head_dim,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, HAD_LOG: tl.constexpr,
                 NORM: tl.constexpr, INV_SCALE: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 MAX_CODE: tl.constexpr, ROUND_BF16: tl.constexpr):
        """BLOCK_R rows (token t, head h: row t Hkv + h) of k (program_id(1) 0) or v (1) into
        the pool at slots[t]."""
        is_v = tl.program_id(1) == 1
        src = tl.where(is_v, v_ptr, k_ptr)
        dst = tl.where(is_v, vc_ptr, kc_ptr)
        s0 = tl.where(is_v, v_s0, k_s0).to(tl.int64)
        s1 = tl.where(is_v, v_s1, k_s1).to(tl.int64)
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        row_ok = row < n_rows
        t, h = row // n_heads, row % n_heads
        d = tl.arange(0, BLOCK_D)  # [BD]
        ok = row_ok[:, None] & (d < head_dim)[None, :]
        x = tl.load(src + (t.to(tl.int64) * s0 + h * s1)[:, None] + d[None, :], mask=ok, other=0.0)  # [BR, BD]
        slot = tl.load(slots_ptr + t, mask=row_ok, other=0).to(tl.int64)
        where = dst + (slot * c_s0 + h * head_dim)[:, None] + d[None, :]
        if FP8:
            y = x.to(tl.float32)
            # hadamard_rotate's butterflies: stage s pairs element j with j + 2^s inside groups of
            # 2^(s+1) (blocks of n = 2^HAD_LOG divide BLOCK_D, so padding never mixes with data)
            for s in tl.static_range(HAD_LOG):
                pairs = tl.permute(tl.reshape(y, [BLOCK_R, BLOCK_D // (2 << s), 2, 1 << s]), [0, 1, 3, 2])
                a, b = tl.split(pairs)  # [BR, BD / 2^(s+1), 2^s] each
                y = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [BLOCK_R, BLOCK_D])
            y = y * NORM * INV_SCALE  # two roundings, as the reference: (H x) then / scale (exact)
            # float32 -> float8 bits, round to nearest even (module docstring: torch's edge cases)
            bits = y.to(tl.int32, bitcast=True)
            sign = (bits >> 24) & 0x80
            mag = bits & 0x7FFFFFFF
            exp = mag >> 23
            # normal results: rebias the exponent, round the dropped 23 - MBITS mantissa bits
            normal = (mag - ((127 - BIAS) << 23) + ((1 << (22 - MBITS)) - 1) + ((mag >> (23 - MBITS)) & 1)) \
                >> (23 - MBITS)
            normal = tl.minimum(normal, MAX_CODE)
            # subnormal results: the mantissa (implicit bit included) shifted to the format's
            # smallest step 2^(1 - BIAS - MBITS); the shift clamped so it stays defined
            mant = (mag & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
            shift = tl.minimum(tl.maximum(151 - BIAS - MBITS - exp, 1), 25)
            kept = mant >> shift
            half_bit = (mant >> (shift - 1)) & 1
            sticky = (mant - ((mant >> (shift - 1)) << (shift - 1))) != 0
            sub = kept + (half_bit & (sticky.to(tl.int32) | (kept & 1)))
            code = tl.where(exp >= 128 - BIAS, normal, sub)
            code = tl.where(mag > 0x7F800000, 0x7F, code) | sign
            tl.store(where, code.to(tl.uint8), mask=ok)
        elif ROUND_BF16:  # round to nearest even by the bits (the interpreter's cast truncates)
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
            tl.store(where, (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=ok)
        else:
            tl.store(where, x.to(dst.dtype.element_ty), mask=ok)

    return write_kv
