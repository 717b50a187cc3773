"""One layer's attention variant: what a layer asks of the attention backend.

The model's layers build it (Gemma 2's per-layer scale, window and soft-cap) and hand it to the
backend's forward with their q, k, v; every backend (services/worker/attention) honours it. It
lives with the model because it describes the model's layers: the backends import it from here,
and the model never imports a backend (it is handed one).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention variant, for models whose layers differ (Gemma 2): the backend's
    own scale and window apply to a layer that passes none."""

    scale: float  # multiplies q . k
    window: int | None = None  # a query at position p sees keys p - window + 1 .. p; None = all
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask
