"""KV page tensors ↔ the store's opaque payload bytes.

A page is one tensor [num_layers, 2 (k, v), page_size, num_kv_heads, head_dim]
of the pool's dtype (an MLA latent pool's, PageSpec.latent_dim > 0, is [num_layers, 1 (k alone),
page_size, 1, head_dim]: its V is K's first latent_dim columns, so no byte is stored twice),
stored as its raw contiguous bytes (native byte order; the dtype and shape are not in the
payload: they are part of the key's namespace, see services/common/page_hash.kv_layout, so a
payload is only ever decoded with the spec that encoded it). Decoding checks the length, so a
payload of another layout reads as a miss rather than garbage.

From the worker's pool (k, v: [L, S, Hkv, D], see services/worker/kv_pool.py),
a page whose slots are `slots` [P] is `torch.stack([t[:, slots] for t in pool.tensors], 1)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kernels.kv_fp8 import FP8_KV_ROTATION, FP8_KV_SCALES
from services.common.page_hash import kv_layout


@dataclass(frozen=True)
class PageSpec:
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # > 0: a latent page (MLA): one KV head of head_dim, k alone, V = K[..., :latent_dim]
    latent_dim: int = 0

    def __post_init__(self) -> None:
        if self.latent_dim and not (self.num_kv_heads == 1 and 0 < self.latent_dim < self.head_dim):
            raise ValueError(f"a latent page has one KV head and latent_dim < head_dim, got {self.num_kv_heads} "
                             f"heads, head_dim {self.head_dim}, latent_dim {self.latent_dim}")

    @classmethod
    def from_pool(cls, spec) -> "PageSpec":
        """From a services.worker.kv_pool.KVPoolSpec (duck-typed: no worker import here)."""
        return cls(spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim, spec.dtype,
                   latent_dim=spec.latent_dim)

    @property
    def kv_tensors(self) -> int:
        """Tensors a page holds: 2 (k, v), or 1 (k) for a latent page."""
        return 1 if self.latent_dim else 2

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[L, kv_tensors, P, Hkv, D]."""
        return (self.num_layers, self.kv_tensors, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def layout(self) -> str:
        """The kv_layout string for this page's KeyNamespace: an FP8 page's names its format,
        scale and rotation ("float8_e4m3fn*0.25+hadamard"), so no page is ever read under
        another dtype, scale or rotation; a latent page's names its latent width ("...:KV1:...:latent32")."""
        name = str(self.dtype).removeprefix("torch.")
        if self.dtype in FP8_KV_SCALES:
            name += f"*{FP8_KV_SCALES[self.dtype]:g}+{FP8_KV_ROTATION}"
        return kv_layout(name, self.num_layers, self.num_kv_heads, self.head_dim, latent_dim=self.latent_dim)


def encode(page: torch.Tensor, spec: PageSpec) -> bytes:
    """One page tensor → bytes. Raises ValueError when its shape or dtype is not the spec's."""
    if tuple(page.shape) != spec.shape or page.dtype != spec.dtype:
        raise ValueError(f"page must be {spec.shape} {spec.dtype}, got {tuple(page.shape)} {page.dtype}")
    flat = page.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().tobytes()


def decode(payload: bytes, spec: PageSpec) -> torch.Tensor | None:
    """bytes → a fresh (writable, CPU) page tensor; None when the length is not the spec's."""
    pages, ok = decode_batch([payload], spec)
    return pages[0] if ok[0] else None


def decode_batch(payloads: Sequence[bytes], spec: PageSpec) -> tuple[torch.Tensor, list[bool]]:
    """Payloads → one fresh tensor [n, *spec.shape] and, per payload, whether it had the
    spec's length (a row whose payload did not is left uninitialized).

    The copies are numpy memcpys on the calling thread: torch ops here would start
    intra-op threads, which on a loaded CPU made a 47 MB stack take seconds.
    """
    out = torch.empty((len(payloads), *spec.shape), dtype=spec.dtype)
    ok = [len(p) == spec.nbytes for p in payloads]
    if payloads:
        rows = out.view(len(payloads), -1).view(torch.uint8).numpy()  # [n, nbytes], shares memory
        for i, payload in enumerate(payloads):
            if ok[i]:
                rows[i] = np.frombuffer(payload, dtype=np.uint8)
    return out, ok
