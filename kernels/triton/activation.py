"""SiLU-and-mul (SwiGLU's activation) on the GPU, with the LayerOps.silu_mul contract
(services/worker/model/layer_ops.py), and its torch reference.

silu_mul(gate_up [T, 2I]) -> [T, I]: out[t, i] = silu(gate[t, i]) * up[t, i], gate the first I
columns and up the last I, as g / (1 + exp(-g)) * u in float32, rounded to the dtype once (the
fused CPU kernel's formula; TorchLayerOps rounds silu(gate) first, so bfloat16 results may differ
from it by one rounding). One program per token and block of columns. Under the interpreter
bfloat16 results are rounded by their bits (rms_norm.py says why). Triton is imported on first
use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # output columns per program


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] float32/bfloat16/float16 (rows may be strided, the last dim contiguous)
    → a new contiguous [T, I] of its dtype. On a CUDA device (CPU tensors only under
    TRITON_INTERPRET=1). Raises ValueError on a bad shape, stride, dtype or device;
    RuntimeError without triton."""
    triton = _triton()
    _check(gate_up)
    if not gate_up.is_cuda and not (gate_up.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"gate_up is on {gate_up.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if T == 0 or inter == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _kernel(triton.knobs.runtime.interpret)[(T, triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, inter, BLOCK=block,
        ROUND_BF16=bool(triton.knobs.runtime.interpret) and gate_up.dtype == torch.bfloat16)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The same in torch, on any device: float32 math, one rounding."""
    _check(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (gate / (1 + torch.exp(-gate)) * up).to(gate_up.dtype)


def _check(gate_up: torch.Tensor) -> None:
    """The contract both paths share, as ValueErrors a caller can act on."""
    if gate_up.dim() != 2 or gate_up.dtype not in DTYPES or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I] float32/bfloat16/float16, got "
                         f"{list(gate_up.shape)} {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up needs a contiguous last dim, got strides {gate_up.stride()}")


def _triton() -> Any:
    return import_triton("SiLU-and-mul", "silu_mul_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _silu_mul_source)[0]


def _silu_mul_source(tl: Any) -> Any:
    def silu_mul(gu_ptr, gu_stride, out_ptr, inter, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        """Token program_id(0), output columns [program_id(1) BLOCK, +BLOCK)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        ok = cols < inter
        g = tl.load(gu_ptr + t * gu_stride + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * gu_stride + inter + cols, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u  # exp overflows to inf for g < -88: silu is then -0, as it should
        if ROUND_BF16:  # round to nearest even by the bits (the interpreter's cast truncates)
            bits = y.to(tl.int32, bitcast=True)
            bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
            out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            out = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * inter + cols, out, mask=ok)

    return silu_mul
