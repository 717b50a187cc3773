"""Which fused multi-LoRA kernel serves a device: the C++ kernel on CPU (kernels/lora_cpu.py), the
Triton SGMV kernel on CUDA (kernels/triton/lora_sgmv.py). Both take lora_apply_(x, y, a, b, segs,
order, groups) on the same layouts, so fused.FusedSlots holds and calls either; None leaves a
device on stacked.py's torch paths."""
from __future__ import annotations

from types import ModuleType

import torch

from kernels import lora_cpu
from kernels.triton import lora_sgmv


def fused_kernel(device: torch.device) -> ModuleType | None:
    """The kernel module for stacks on `device`, or None (not built here, no triton, another device)."""
    if device.type == "cpu":
        return lora_cpu.load()
    if device.type == "cuda" and _has_triton():
        return lora_sgmv
    return None


def serves(module: ModuleType | None, device: torch.device) -> bool:
    """Whether `module` (fused_kernel's answer for some device) runs on `device`."""
    if module is None:
        return False
    return device.type == ("cuda" if module is lora_sgmv else "cpu")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
