"""Quantized weights as a Linear or an embedding holds them: one QuantWeight, or several stacked.

A fused projection (qkv, gate_up) is one QuantWeight when its parts share a format
(`QuantWeight.cat_rows`). GGUF files in the wild often mix them: a Q4_K_M file stores
attn_v and some ffn_down in Q6_K beside Q4_K q/k/gate/up. Those fuse into `QuantParts`:
the parts are kept as they are and a call computes each and concatenates the outputs, so
a mixed file still runs on its own blocks with no dense copy.

`select_rows` picks rows (an embedding lookup on the blocks); it indexes every per-row
tensor of the QuantWeight, which holds whatever B's layout keeps per output row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.quant_gemv import QuantWeight, quant_linear


@dataclass
class QuantParts:
    """Weights of one input size stacked along the output rows, each in its own format."""

    parts: list[QuantWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def qtype(self) -> str:
        return "+".join(dict.fromkeys(p.qtype for p in self.parts))

    def dequantize(self) -> torch.Tensor:
        """→ float32 [N, K]."""
        return torch.cat([p.dequantize() for p in self.parts])


QuantLike = QuantWeight | QuantParts


def fuse(parts: list[QuantWeight]) -> QuantLike:
    """Row-stack weights of one input size: one QuantWeight when they share a format, else QuantParts."""
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse weights of input sizes {[p.shape[1] for p in parts]}")
    if len(parts) == 1:
        return parts[0]
    if len({p.qtype for p in parts}) == 1:
        return QuantWeight.cat_rows(parts)
    return QuantParts(list(parts))


def linear(x: torch.Tensor, w: QuantLike, bias: torch.Tensor | None, kernel: ModuleType | None,
           float_out: bool = False) -> torch.Tensor:
    """x [T, K] @ w^T (+ bias) → [T, N] in x's dtype (float32 when float_out), float32 math."""
    if isinstance(w, QuantWeight):
        return quant_linear(x, w, bias, kernel, float_out=float_out)
    outs, start = [], 0
    for p in w.parts:
        n = p.shape[0]
        b = None if bias is None else bias[start:start + n]
        outs.append(quant_linear(x, p, b, kernel, float_out=float_out))  # [T, n]
        start += n
    return torch.cat(outs, dim=-1)


def select_rows(w: QuantLike, rows: torch.Tensor) -> QuantLike:
    """The weight's rows `rows` (int64 [R]) as a weight of shape [R, K] in the same format."""
    if isinstance(w, QuantParts):
        raise ValueError("row lookup is for one-format weights (an embedding), not fused mixed ones")
    n = w.shape[0]
    picked = {}
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        picked[f.name] = v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v
    return dataclasses.replace(w, **picked)

