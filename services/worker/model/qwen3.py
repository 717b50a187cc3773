"""Qwen3 (Qwen3ForCausalLM): the Llama decoder plus a per-head RMSNorm on q and k before RoPE.

The math is llama.py's: `Attention` holds the two norms when `ModelConfig.qk_norm` is set, and
the checkpoint's `self_attn.q_norm.weight` / `k_norm.weight` load under their HF names. q/k/v
carry no bias (`attention_bias`, False in Qwen3's config.json) and head_dim is explicit
(often not hidden_size / heads).
"""
from __future__ import annotations

from typing import Any


def qwen3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Qwen3 sets beyond the Llama ones."""
    return {"qk_norm": True}
