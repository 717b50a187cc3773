"""Host memory that comes back: large zeroed buffers the OS fills on first touch, and a trim
that hands freed heap pages back to it.

A KV pool is sized for the most it may ever hold, but a process touches only the pages its
requests write. `torch.zeros` writes every byte at once (a 3 GiB pool is 3 GiB of RSS before
the first request); an anonymous mapping is zero by the kernel's guarantee and costs RSS only
for the pages written. The mapping is unmapped when the last tensor viewing it is freed.

glibc keeps freed small allocations in its arenas (one per thread that allocated), so after
an engine is gone its process can hold a gigabyte it no longer uses; `return_freed_memory`
asks glibc to give those pages back (malloc_trim), as the engines' shutdown does.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import mmap

import torch


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros whose pages are mapped on first write (no RSS until then)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor's storage holds the buffer export; the mapping closes once the storage is freed.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


def return_freed_memory() -> bool:
    """Collect cycles, then return the heap pages that are free to the OS. True when trimmed."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
