"""Process-level CPU settings that the forward pass depends on for speed."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_TOP_PAD = -2


def keep_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Stop glibc from returning large freed blocks to the OS.

    Every op of a forward pass allocates its output; blocks above glibc's mmap
    threshold are mmapped fresh and page-faulted in on every step, which made a
    decode step's KV gathers ~2x slower here. Raising both thresholds keeps the
    blocks in the heap for reuse. That alone still faulted on every step for
    the [batch, vocab] logits (torch's 64-byte-aligned blocks rarely fit the
    hole a freed one left, so the heap grew into fresh pages: ~3 ms a step at
    batch 56); a 256 MiB top pad grows the heap in steps large enough to be
    reused (bench/step_profile.py --trace: aten::copy_ 3.5 -> 0.7 ms). Only
    touched pages count as memory. Returns False where libc is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1
        ok &= libc.mallopt(_M_MMAP_THRESHOLD, min(threshold_bytes, 1 << 30)) == 1
        ok &= libc.mallopt(_M_TOP_PAD, 256 << 20) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("mallopt unavailable: large allocations stay mmapped")
    return ok
