"""The element-wise ops of a decoder layer, in two implementations with one contract.

`TorchLayerOps` is the reference: plain torch, the same sequence of roundings
as Hugging Face's Llama. `FusedCpuLayerOps` runs each op as one C++ kernel
(kernels/cpu/fused_ops.cpp): math in float32, rounded to the dtype once.
In float32 the two agree to a few ulps; in bfloat16 the fused one is the more
accurate. At decode batch sizes the fused ops remove most of the layer's
dispatch overhead (~25 small ops per layer become 4).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x if residual is None else residual + x (in x's dtype);
        returns (rms_norm(residual') * weight, residual'). x [T, H]."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] → [T, H]: normalized in float32, rounded, then scaled by weight."""

    def rope_qk(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] → the same with q and k rotated (rotate-half layout).
        cos, sin [P, D] float32 tables indexed by positions [T]. May work in place."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] → silu(gate) * up [T, I]."""


class TorchLayerOps:
    def rms_norm(self, x, weight, eps):
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
        return weight * normed

    def add_rms_norm(self, x, residual, weight, eps):
        residual = x if residual is None else residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope_qk(self, qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim):
        T = qkv.shape[0]
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        c = cos[positions].unsqueeze(1).to(qkv.dtype)  # [T, 1, D]
        s = sin[positions].unsqueeze(1).to(qkv.dtype)
        q = qkv[:, :q_end].view(T, num_heads, head_dim)
        k = qkv[:, q_end:k_end].view(T, num_kv_heads, head_dim)
        rotated = [x * c + _rotate_half(x) * s for x in (q, k)]
        return torch.cat([rotated[0].reshape(T, -1), rotated[1].reshape(T, -1), qkv[:, k_end:]], dim=-1)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedCpuLayerOps:
    def __init__(self, module):
        self.m = module  # the compiled kernels/cpu/fused_ops.cpp

    def rms_norm(self, x, weight, eps):
        return self.m.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        x = x.contiguous()
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        return self.m.add_rms_norm_(x, residual, weight, eps, first), residual

    def rope_qk(self, qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim):
        self.m.rope_(qkv, positions, cos, sin, num_heads + num_kv_heads)
        return qkv

    def silu_mul(self, gate_up):
        return self.m.silu_mul(gate_up.contiguous())


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] → gelu_tanh(gate) * up [T, I] (GeGLU, Gemma's MLP; plain torch in both op sets)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def create_layer_ops(fused: bool, device: torch.device) -> LayerOps:
    """The layer ops for a model on `device`:
    CPU: the fused C++ ops when `fused` and buildable here, else the torch reference;
    CUDA: the Triton ops (triton_layer_ops.py) when triton imports, else the torch reference
    (`fused` names the CPU kernels and is not consulted);
    any other device: the torch reference."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  (CUDA builds of torch ship it)
        except ImportError:
            return TorchLayerOps()
        from services.worker.model.triton_layer_ops import TritonLayerOps
        return TritonLayerOps()
    if fused and device.type == "cpu":
        from kernels import fused_cpu
        module = fused_cpu.load()
        if module is not None:
            return FusedCpuLayerOps(module)
    return TorchLayerOps()
