"""RMSNorm and the fused residual add + RMSNorm on the GPU, with the LayerOps contract
(services/worker/model/layer_ops.py), and their torch references.

rms_norm(x, weight, eps) = dtype(weight * dtype(x * rsqrt(mean(x^2) + eps))), math in float32.
add_rms_norm(x, residual, weight, eps): residual' = dtype(residual + x), or x when residual is
None; returns (rms_norm(residual', weight, eps), residual'). Each value is rounded to the dtype
once where the C++ kernel (kernels/cpu/layer_ops.h) rounds it: the residual sum, the normalized
value before the weight (as Hugging Face's Llama and TorchLayerOps round it), the output.
One program per row, the whole row in registers (H <= 65536).

The residual is updated in place when given (as FusedCpuLayerOps does: the model rebinds it
every layer, so nobody else holds the old one); when None, residual' is a new tensor holding a
copy of x, so later in-place adds never write into the caller's x.

Under Triton's interpreter a float32 -> bfloat16 cast truncates, where a GPU rounds to nearest
even; the kernel rounds the bits itself there (ROUND_BF16), so interpreted results are the GPU's.
Triton is imported on first use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kernels.triton import import_triton, jitted

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HIDDEN = 65536  # one row in one program's registers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] float32/bfloat16/float16 (rows may be strided, the last dim contiguous), weight
    [H] of x's dtype, contiguous → a new contiguous [T, H]. On a CUDA device (CPU tensors only
    under TRITON_INTERPRET=1). Raises ValueError on a bad shape, stride, dtype or device."""
    _check(x, None, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, H]
    _launch(x, None, weight, out, eps, mode=0)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], residual [T, H] of x's dtype or None, weight [H] → (out [T, H], residual'):
    the residual updated in place and returned, or when None a new copy of x. Layouts, devices
    and errors as rms_norm."""
    _check(x, residual, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, H]
    if residual is None:
        residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(x, residual, weight, out, eps, mode=2)
    else:
        _launch(x, residual, weight, out, eps, mode=1)
    return out, residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in torch, on any device: the same roundings, torch's summation order."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm in torch, out of place (the residual is not modified)."""
    residual = x.clone() if residual is None else residual + x  # one rounding: torch adds in float32
    return rms_norm_reference(residual, weight, eps), residual


def _launch(x, residual, weight, out, eps: float, mode: int) -> None:
    """mode 0: norm x; 1: residual += x, norm it; 2: residual = x, norm it."""
    triton = _triton()
    if not x.is_cuda and not (x.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"x is on {x.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    T, H = x.shape
    if T == 0 or H == 0:
        return
    block = triton.next_power_of_2(H)
    res = x if residual is None else residual  # mode 0 never touches it
    _kernel(triton.knobs.runtime.interpret)[(T,)](
        x, x.stride(0), res, res.stride(0), weight, out, H, float(eps),
        MODE=mode, BLOCK=block, ROUND_BF16=bool(triton.knobs.runtime.interpret) and x.dtype == torch.bfloat16,
        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """The contract both paths share, as ValueErrors a caller can act on."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [T, H] float32/bfloat16/float16, got {list(x.shape)} {x.dtype}")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"rows of {x.shape[1]} exceed the kernel's {MAX_HIDDEN}")
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [H = {x.shape[1]}] {x.dtype}, "
                         f"got {list(weight.shape)} {weight.dtype}")
    for name, t in (("residual", residual), ("weight", weight)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: move it first")


def _triton() -> Any:
    return import_triton("RMSNorm", "rms_norm_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _norm_source)[0]


def _norm_source(tl: Any) -> Any:
    def norm_rows(x_ptr, x_stride, r_ptr, r_stride, w_ptr, out_ptr, n, eps,
                  MODE: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        """One row: the optional residual add (stored), then the norm (stored to out)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)  # [BLOCK]
        ok = cols < n
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
        if MODE == 1:
            s = tl.load(r_ptr + row * r_stride + cols, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)
            if ROUND_BF16:  # round to nearest even by the bits (the interpreter's cast truncates)
                bits = s.to(tl.int32, bitcast=True)
                bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000,
                                bits + 0x7FFF + ((bits >> 16) & 1))
                x = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                x = s.to(dtype)
            tl.store(r_ptr + row * r_stride + cols, x, mask=ok)
        elif MODE == 2:
            tl.store(r_ptr + row * r_stride + cols, x, mask=ok)
        v = x.to(tl.float32)
        # tl.sum's own reduction, called as tl.reduce: tl.sum is a jitted helper the interpreter
        # does not patch once triton was imported before the knob was set (see lora_sgmv.py)
        rstd = tl.rsqrt(tl.reduce(v * v, 0, tl.standard._sum_combine) / n + eps)
        normed = v * rstd
        if ROUND_BF16:
            bits = normed.to(tl.int32, bitcast=True)
            bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
            normed = (bits & -65536).to(tl.float32, bitcast=True)
        else:
            normed = normed.to(dtype).to(tl.float32)  # rounded before the weight, as the reference
        y = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed
        if ROUND_BF16:
            bits = y.to(tl.int32, bitcast=True)
            bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
            out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            out = y.to(dtype)
        tl.store(out_ptr + row * n + cols, out, mask=ok)

    return norm_rows
