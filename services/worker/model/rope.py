"""Rotary position embeddings, with Llama-3 frequency scaling."""
from __future__ import annotations

import math

import torch

from services.worker.model.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, scaled as `rope_scaling` asks."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly (Llama 3.1's recipe).
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables [positions, head_dim] (HF's rotate-half layout);
    the layer ops (layer_ops.py) apply them."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        n = max_positions or config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_frequencies(config))
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)
