"""Mistral (MistralForCausalLM): the Llama decoder with sliding-window attention.

With `sliding_window` W, the query at position p attends to keys at p - W + 1 .. p only
(transformers' sliding-window causal mask). The torch attention backend masks the older keys;
the native paged decode kernel and the one-call decode stack have no window and are declined
for such a model (attention/torch_backend.py, LlamaForCausalLM.use_decode_stack).
"""
from __future__ import annotations

from typing import Any


def mistral_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Mistral sets beyond the Llama ones."""
    return {"sliding_window": effective_window(raw)}


def effective_window(raw: dict[str, Any]) -> int | None:
    """config.json's sliding_window, or None when it cannot drop a key (null, or at least the
    model's whole context): such a model keeps the native decode kernel and the decode stack."""
    window = raw.get("sliding_window")
    if window is None or window >= raw.get("max_position_embeddings", float("inf")):
        return None
    return int(window)
