"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's decoder (q/k RMSNorm, no q/k/v bias) whose MLPs are
sparse mixture-of-experts blocks (moe.py): num_experts SwiGLU experts of moe_intermediate_size,
num_experts_per_tok of them per token, no shared expert.

Which layers are sparse follows transformers' Qwen3MoeDecoderLayer: layer i is, unless it is in
mlp_only_layers or (i + 1) % decoder_sparse_step != 0, when it is a dense MLP of
intermediate_size (ModelConfig.is_moe_layer). The released models are sparse everywhere
(step 1, no mlp-only layers). Refused: an activation other than SiLU, and num_experts_per_tok
outside 1 .. num_experts. use_sliding_window is refused by the loader for every Qwen.
The one-call decode stack and the GGUF quantized path have no experts (decode_stack_refusal).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.llama import MLP, LlamaForCausalLM
from services.worker.model.moe import SparseMoeBlock, routing_fields


def qwen3_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Qwen3-MoE sets beyond the Llama ones."""
    # transformers' attribute_map writes num_experts as num_local_experts; older configs as num_experts
    experts, top_k = routing_fields(raw, "Qwen3-MoE", ("num_experts", "num_local_experts"), 128, 8)
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"Qwen3-MoE decoder_sparse_step={step} must be at least 1")
    return {"qk_norm": True, "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(raw.get("moe_intermediate_size", 768)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "decoder_sparse_step": step,
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ())}


def qwen3_moe_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a sparse block, or a dense MLP of intermediate_size."""
    if not config.is_moe_layer(layer):
        return MLP(config)
    return SparseMoeBlock.for_layer(config, layer)


def qwen3_moe_model(config: ModelConfig) -> LlamaForCausalLM:
    """The registry's constructor for Qwen3MoeForCausalLM: the Llama decoder with these MLPs."""
    return LlamaForCausalLM(config, mlp_for_layer=qwen3_moe_mlp)
