"""The grammar token bitmask applied to logits on CPU (kernels/cpu/token_bitmask.cpp), built on
first use, and its torch reference.

A constrained row allows few tokens at most positions, so applying the mask is mostly filling
-inf: the kernel does that per row on the step's threads, several times faster than xgrammar's
own CPU kernel or an unpacked-bits `masked_fill_` at the default vocabulary (docs/benchmarks.md).
"""
from __future__ import annotations

from types import ModuleType

import torch

from kernels.cpu_build import load_cpu_extension

_BITS = torch.arange(32, dtype=torch.int32)


def load() -> ModuleType | None:
    """The compiled module (apply_token_bitmask_), or None if it cannot be built here."""
    return load_cpu_extension("token_bitmask_cpu", "token_bitmask.cpp")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [B, V] float (last dim contiguous), bitmask [B, ceil(V / 32)] int32: -inf in place
    where a listed row's bit is 0. Falls back to the reference when the kernel is not built."""
    module = load()
    if module is None:
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    module.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.int64))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The same in torch: unpack each listed row's words to bits, fill where a bit is 0."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64)
    words = bitmask[index]  # [R, W]
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :logits.shape[-1]]  # [R, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
