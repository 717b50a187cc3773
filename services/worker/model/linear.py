"""Linear layers that can run on oneDNN-prepacked weights on CPU.

A plain `F.linear` in bfloat16 re-lays out the weight for the AMX/AVX-512
kernels on every call; prepacking does it once at load. It is what
`torch.compile` with freezing does for CPU linears, without compiling: the
same oneDNN kernel, called eagerly. Measured on this project's 2-core
Sapphire Rapids box (bench/ceilings.py): the decode step's linears take about
half the time at batch 1 and 0.7x at batch 64. The results are bit-identical
to `F.linear` and do not depend on the batch size (tests/unit/test_linear.py).

Only bfloat16 and float16 weights are packed: float32 goes through MKL's
sgemm, which prepacking does not beat at small batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def can_prepack(weight: torch.Tensor) -> bool:
    """True when oneDNN can prepack this weight here (CPU, half precision, oneDNN built in)."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available())


def prepack(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor:
    """weight [out, in] → an opaque oneDNN tensor for `packed_linear` (any batch size
    works; a hint picks the blocking for that size, None suits them all)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) → [..., out], in x's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear plus an optional prepacked copy of the weight used for compute.

    The plain `weight` stays the source of truth (loaders and weight updates
    write it); call `prepack()` again after changing it.
    """

    packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        self.packed = prepack(self.weight) if can_prepack(self.weight) else None
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
