"""A draft head's linears on int8 weights (CPU): a draft step reads the head's weights once per
token, as a target step does, so at batch 1 it is bound by their bytes. In float32 the default
model's EAGLE-3 head reads ~20 MB a step (2 ms on one core here, a quarter of the target's step);
int8 per-channel weights (kernels/quant_gemv.py, the worker's `--quantization int8` kernel) read
a quarter of that. Drafts change a little with the rounding; outputs do not (the target verifies
every drafted token).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import quant_gemv
from kernels.quant_gemv import QuantWeight


class Int8Linear(nn.Module):
    """nn.Linear's forward on an int8 per-channel copy of its weight: x [T, K] → [T, N] in x's dtype."""

    def __init__(self, linear: nn.Linear, kernel) -> None:
        super().__init__()
        self.weight_q = QuantWeight.int8_per_channel(linear.weight.detach().float())
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.kernel = kernel
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_gemv.quant_linear(x, self.weight_q, self.bias, self.kernel)


def quantize_linears(head: nn.Module) -> int:
    """Swap every nn.Linear of `head` whose input size is a multiple of the kernel's group (32) for
    an Int8Linear → how many were swapped (0 when the kernel cannot be built here)."""
    kernel = quant_gemv.load()
    if kernel is None:
        return 0
    swapped = 0
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % quant_gemv.BLOCK == 0:
                setattr(parent, name, Int8Linear(child, kernel))
                swapped += 1
    return swapped
