"""A step's host-built index tensors moved to the device in one pinned, non-blocking copy.

The worker plans a step on the host (token ids, positions, page-table rows, slots: small int64
tensors). On a CUDA device, one copy per tensor would cost a launch and, from pageable memory,
a host sync each; packed into one pinned buffer they cross in one asynchronous copy that the
step's first kernel is queued behind. On the CPU nothing moves.
"""
from __future__ import annotations

import torch


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors (any shapes) → the same values on `device`, in order. CPU: the tensors
    themselves. CUDA: views into one device buffer filled by one non-blocking copy from pinned
    memory (torch's caching host allocator makes the pin cheap after the first steps)."""
    if device.type == "cpu":
        return tensors
    for t in tensors:
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"to_device packs int64 host tensors, got {t.dtype} on {t.device}")
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory()
    on_device = flat.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        out.append(on_device[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out
