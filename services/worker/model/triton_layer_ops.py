"""The decoder layer's element-wise ops on CUDA as Triton kernels (kernels/triton/): the LayerOps
contract of services/worker/model/layer_ops.py, one launch per op.

Numerics are the fused CPU ops' (FusedCpuLayerOps): math in float32, each result rounded to the
dtype once; in float32 they agree with TorchLayerOps to a few ulps, in bfloat16 to about one
ulp (TorchLayerOps rounds after every op). Like FusedCpuLayerOps, add_rms_norm updates a given
residual in place and rope_qk rotates qkv in place; the model rebinds both every layer.

Importing this module does not import triton (the kernel modules import it on first use), so
services/worker/model/layer_ops.py can name it on any machine; create_layer_ops picks it only on
a CUDA device where triton imports.
"""
from __future__ import annotations

import torch

from kernels.triton import activation, rms_norm, rope


class TritonLayerOps:
    """LayerOps on CUDA tensors (CPU tensors only under TRITON_INTERPRET=1, as the tests run it).
    Shapes and errors are the kernels': ValueError on a shape, stride, dtype or device they do
    not take."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] → [T, H]: normalized in float32, rounded, then scaled by weight (rounded once)."""
        return rms_norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual') * weight, residual'), residual' = residual + x written into
        residual, or a new copy of x when residual is None. x [T, H]."""
        return rms_norm.add_rms_norm(x, residual, weight, eps)

    def rope_qk(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] with q and k rotated in place (rotate-half layout); returns qkv."""
        return rope.rope_qk_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] → silu(gate) * up [T, I]."""
        return activation.silu_mul(gate_up)
