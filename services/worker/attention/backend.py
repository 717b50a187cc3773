"""What an attention backend implements (torch reference now; Triton and FlashInfer later)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.worker.attention.batch_layout import BatchLayout
from services.worker.kv_pool import KVPool


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention variant, for models whose layers differ (Gemma 2): the backend's
    own scale and window apply to a layer that passes none."""

    scale: float  # multiplies q . k
    window: int | None = None  # a query at position p sees keys p - window + 1 .. p; None = all
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask


class AttentionBackend(Protocol):
    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        """Build per-step index tensors once; every layer's `forward` reuses them."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        """Write this step's k, v [T, Hkv, D] into the pool, attend q [T, H, D]
        causally over each request's KV (as `variant` says, when given), and return [T, H, D]."""


# name -> (factory "module:attr", keyword arguments)
_BACKENDS: dict[str, tuple[str, dict]] = {
    "torch": ("services.worker.attention.torch_backend:TorchAttentionBackend", {}),
    # torch, plus the C++ paged decode kernel (built on first use; falls back if it cannot be)
    "cpu": ("services.worker.attention.torch_backend:TorchAttentionBackend", {"native_decode": True}),
}


def create_backend(name: str, scale: float, sliding_window: int | None = None) -> AttentionBackend:
    """sliding_window: each query attends only to the last that many positions (None: all)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    target, kwargs = _BACKENDS[name]
    module, cls = target.split(":")
    import importlib
    return getattr(importlib.import_module(module), cls)(scale=scale, sliding_window=sliding_window, **kwargs)
