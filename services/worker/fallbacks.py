"""The slower paths a CPU worker took, and why: said once, at WARNING, when it starts.

A worker that silently runs plain torch because a kernel did not build, or
float32 because the CPU has no bfloat16 instructions, looks like a slow
machine. Each entry names the path and the reason, so the log says which.
"""
from __future__ import annotations

import logging

import torch

from kernels import cpu_build, cpu_isa

log = logging.getLogger(__name__)


def cpu_fallbacks(config, prepacked: bool) -> list[str]:
    """Why this CPU worker runs slower paths than the best this build has: one line each,
    [] when it runs them all. config: a WorkerConfig; prepacked: the model's linears were."""
    if not config.device.startswith("cpu"):
        return []
    from services.worker.model.linear import PACKABLE_DTYPES, prepack_refusal
    found = [f"CPU kernel {name}: {why}; its plain-torch path runs instead"
             for name, why in sorted(cpu_build.unavailable.items())]
    if config.dtype == "auto" and not cpu_isa.has_fast_bf16():
        found.append("--dtype auto runs float32: this CPU has no bfloat16 matmul instructions "
                     "(AVX-512 BF16 or AMX-BF16)")
    if config.torch_dtype in PACKABLE_DTYPES and config.prepack_weights and not prepacked:
        found.append(f"{config.resolved_dtype} linears run unpacked (F.linear): "
                     f"{prepack_refusal(config.torch_dtype) or 'a weight could not be packed'}")
    if not cpu_isa.has_avx512():
        found.append("no AVX-512 (F/BW/VL/DQ): the quantized GEMV and paged attention kernels run their "
                     "256-bit AVX2 paths (an FP8 KV cache: portable loops)")
    return found


def warn_cpu_fallbacks(config, prepacked: bool) -> list[str]:
    """Log the CPU line and each fallback once; returns the fallbacks."""
    found = cpu_fallbacks(config, prepacked)
    if config.device.startswith("cpu"):
        log.info("CPU: %s; torch %s capability", cpu_isa.describe(), torch.backends.cpu.get_cpu_capability())
    for line in found:
        log.warning("slower path: %s", line)
    return found
