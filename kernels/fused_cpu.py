"""Fused element-wise layer ops on CPU (kernels/cpu/fused_ops.cpp), built on first use.

The contract and the torch reference live in services/worker/model/layer_ops.py.
"""
from __future__ import annotations

from types import ModuleType

from kernels.cpu_build import load_cpu_extension


def load() -> ModuleType | None:
    """The compiled module (rms_norm, add_rms_norm_, rope_, silu_mul), or None if it cannot be built."""
    return load_cpu_extension("fused_cpu", "fused_ops.cpp")
