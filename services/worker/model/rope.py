"""Rotary position embeddings, with Llama-3, linear and YaRN frequency scaling."""
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
    elif kind == "yarn":
        inv_freq = _yarn_scale(inv_freq, scaling, dim, config.rope_theta, config.max_position_embeddings)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, yarn)")
    return inv_freq


def rope_amplitude(config: ModelConfig) -> float:
    """What the cos/sin tables are multiplied by: YaRN's attention factor (given, or from the
    ratio of its two mscale curves, or from the factor alone), 1 for every other RoPE."""
    s = config.rope_scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _yarn_factor(s, config.max_position_embeddings)
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, float(s["mscale"])) / yarn_mscale(factor, float(s["mscale_all_dim"]))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(s: dict, max_positions: int) -> float:
    return float(s.get("factor") or max_positions / float(s["original_max_position_embeddings"]))


def _yarn_scale(inv_freq: torch.Tensor, s: dict, dim: int, theta: float, max_positions: int) -> torch.Tensor:
    # YaRN: frequencies that turn many times within the original context keep their value, those
    # that turn less than once are divided by the factor, and a linear ramp over the dimensions
    # between (found from beta_fast and beta_slow turns) blends the two.
    factor = _yarn_factor(s, max_positions)
    old_ctx = float(s.get("original_max_position_embeddings") or max_positions)

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns `turns` times in old_ctx
        return dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_turning(float(s.get("beta_fast") or 32)), dim_turning(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    stretched = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)  # 1: divided
    return inv_freq / factor * stretched + inv_freq * (1 - stretched)


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
        amplitude = rope_amplitude(config)  # YaRN's attention factor; 1 otherwise
        self.register_buffer("cos", (emb.cos() * amplitude).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * amplitude).float(), persistent=False)
