"""Phi-3 (Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up stored fused in the checkpoint.

The checkpoint's `self_attn.qkv_proj.weight` ([q; k; v] rows) and `mlp.gate_up_proj.weight`
([gate; up] rows) are laid out as llama.py's fused linears already, so they load as they are
(LlamaForCausalLM.load_hf_tensors). Refused, since the model code does not compute them:
LongRoPE ("longrope", and its old names "su" / "yarn" that transformers maps to it), a partial
rotary dimension, and any other rope scaling. A sliding_window (2047 in the 4k models) is honoured
as Mistral's is (mistral.py).
"""
from __future__ import annotations

from typing import Any

from services.worker.model.mistral import effective_window

_LONGROPE_NAMES = ("longrope", "su", "yarn")


def phi3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Phi-3 sets beyond the Llama ones; ValueError for a
    rope variant the model code does not compute."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind in _LONGROPE_NAMES:
        raise ValueError(f"Phi-3 rope scaling {kind!r} (LongRoPE: per-frequency short/long factors) is not "
                         "supported; only plain RoPE (the 4k-context Phi-3 models) is")
    if kind != "default":
        raise ValueError(f"Phi-3 rope scaling {kind!r} is not supported; only plain RoPE is")
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"Phi-3 partial_rotary_factor={partial} is not supported (only 1.0: RoPE on the whole head)")
    return {"sliding_window": effective_window(raw)}
