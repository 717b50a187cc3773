"""Mixtral (MixtralForCausalLM): Mistral's decoder (no q/k norm, no biases, a sliding window when
config.json sets one) whose every MLP is a sparse mixture-of-experts block (moe.py):
num_local_experts SwiGLU experts of intermediate_size, num_experts_per_tok of them per token, the
chosen experts' softmax probabilities always renormalized to sum to 1 (transformers'
MixtralTopKRouter), no shared expert. router_jitter_noise perturbs training only; inference ignores it.

Checkpoint names. The Hub's files, and what transformers 5's save_pretrained writes by default,
keep the original names: `layers.N.block_sparse_moe.gate.weight` and per-expert
`block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate / up / down). A
`save_original_format=False` checkpoint has transformers' in-memory names, Qwen3-MoE's:
`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I].
hf_name renames the original ones, tensor by tensor as the loader reads them and before a worker
group's rank cuts its slice, to the per-expert names Qwen3-MoE's Hub files use
(`mlp.experts.{e}.gate_proj.weight`, ...): the names tensor parallelism knows how to cut and that
SparseMoeBlock.fuse_hf stacks.

Refused: an activation other than SiLU, and num_experts_per_tok outside 1 .. num_local_experts.
The one-call decode stack and the GGUF quantized path have no experts (decode_stack_refusal);
a GGUF Mixtral (llama.cpp writes it as `llama` with experts) is refused by gguf_archs.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.llama import LlamaForCausalLM
from services.worker.model.mistral import effective_window
from services.worker.model.moe import SparseMoeBlock, routing_fields

# MixtralConfig's defaults that differ from ModelConfig.from_hf_dict's Llama ones
# (save_pretrained writes both, but a hand-written config.json may omit them).
_ROPE_THETA = 1e6
_CONTEXT = 4096 * 32
# The original per-expert names: w1 = gate_proj, w3 = up_proj, w2 = down_proj.
_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def mixtral_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Mixtral sets beyond the Llama ones."""
    # transformers' attribute_map reads num_experts as num_local_experts
    experts, top_k = routing_fields(raw, "Mixtral", ("num_local_experts", "num_experts"), 8, 2)
    context = int(raw.get("max_position_embeddings", _CONTEXT))
    fields = {"sliding_window": effective_window({**raw, "max_position_embeddings": context}),
              "max_position_embeddings": context, "num_experts": experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}
    if raw.get("rope_theta") is None and (raw.get("rope_parameters") or {}).get("rope_theta") is None:
        fields["rope_theta"] = _ROPE_THETA
    return fields


def mixtral_hf_name(name: str) -> str:
    """A checkpoint tensor's name → the name the Llama decoder and tensor parallelism read:
    `...block_sparse_moe.experts.3.w1.weight` → `...mlp.experts.3.gate_proj.weight`,
    `...block_sparse_moe.gate.weight` → `...mlp.gate.weight`; any other name as it is."""
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PROJ[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.", ".mlp.")


def mixtral_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Every layer's MLP: a sparse block over intermediate_size (moe_intermediate_size here, the
    size tensor parallelism divides among the ranks; an expert-parallel rank's config holds its
    expert slots)."""
    return SparseMoeBlock.for_layer(config, layer)


def mixtral_model(config: ModelConfig) -> LlamaForCausalLM:
    """The registry's constructor for MixtralForCausalLM: the Llama decoder with these MLPs."""
    return LlamaForCausalLM(config, mlp_for_layer=mixtral_mlp)
