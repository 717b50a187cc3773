"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the Llama decoder's residual
stream and norms, with MLA attention (mla.py) over a latent KV pool, and MoE layers of routed
experts picked by a group-limited router (group_router.py: V3's sigmoid with a correction bias,
V2's softmax) beside always-on shared experts.

Layers below first_k_dense_replace are dense MLPs of intermediate_size; every later one is a
sparse block of n_routed_experts experts of moe_intermediate_size, num_experts_per_tok a token,
plus n_shared_experts * moe_intermediate_size of shared MLP. Refused: an activation other than
SiLU, a routing its version does not define (V3: noaux_tc; V2: greedy or group_limited_greedy),
and a RoPE scaling rope.py does not compute (the released models' YaRN it does). The MTP
layers a checkpoint may carry past num_hidden_layers are not loaded here (speculative NEXTN reads
them). The one-call decode stack and the quantized-only paths are declined (decode_stack_refusal).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.group_router import GroupLimitedRouter
from services.worker.model.llama import MLP, LlamaForCausalLM
from services.worker.model.mla import MLAttention
from services.worker.model.moe import SparseMoeBlock, routing_fields
from services.worker.model.rope import yarn_mscale


def deepseek_v3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields DeepSeek-V3 sets beyond the Llama ones."""
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"DeepSeek-V3 topk_method {method!r} is not supported (only 'noaux_tc')")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"DeepSeek-V3 scoring_func {raw['scoring_func']!r} is not supported (only 'sigmoid')")
    return _deepseek_fields(raw, "DeepSeek-V3", 256, 8, 3, "noaux_tc", default_norm=True)


def deepseek_v2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields DeepSeek-V2 (and V2-Lite) sets: softmax routing,
    greedy or group-limited by each group's best score, never renormalised."""
    method = raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported ('greedy', 'group_limited_greedy')")
    if raw.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"DeepSeek-V2 scoring_func {raw['scoring_func']!r} is not supported (only 'softmax')")
    if raw.get("mlp_bias"):
        raise ValueError("DeepSeek-V2 mlp_bias is not supported")
    fields = _deepseek_fields(raw, "DeepSeek-V2", 64, 6, 0, method, default_norm=False)
    return {**fields, "norm_topk_prob": False}  # transformers' V2 router never renormalises


def _deepseek_fields(raw: dict[str, Any], family: str, default_experts: int, default_top_k: int,
                     default_dense: int, method: str, default_norm: bool) -> dict[str, Any]:
    experts, top_k = routing_fields(raw, family, ("n_routed_experts", "num_experts"), default_experts, default_top_k)
    dense = int(raw.get("first_k_dense_replace", default_dense))
    if int(raw.get("moe_layer_freq", 1)) != 1:
        raise ValueError(f"{family} moe_layer_freq={raw['moe_layer_freq']} is not supported (only 1)")
    nope, rope = int(raw.get("qk_nope_head_dim", 128)), int(raw.get("qk_rope_head_dim", 64))
    if rope % 2:
        raise ValueError(f"{family} qk_rope_head_dim={rope} must be even")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(raw.get("moe_intermediate_size", 2048)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", default_norm)), "topk_method": method,
            "n_group": int(raw.get("n_group") or 1), "topk_group": int(raw.get("topk_group") or 1),
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
            "n_shared_experts": int(raw.get("n_shared_experts") or 0),
            "mlp_only_layers": tuple(range(dense)),
            "kv_lora_rank": int(raw.get("kv_lora_rank", 512)), "q_lora_rank": raw.get("q_lora_rank"),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "head_dim": rope,
            "v_head_dim": int(raw.get("v_head_dim", 128)),
            "rope_interleave": bool(raw.get("rope_interleave", True)),  # V2: always (complex pairs)
            "attention_scale": (nope + rope) ** -0.5 * _yarn_mscale_squared(raw)}


def _yarn_mscale_squared(raw: dict[str, Any]) -> float:
    """DeepSeek's attention-scale correction under YaRN, yarn_mscale(factor, mscale_all_dim) ** 2;
    1 without YaRN."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    all_dim = float(scaling.get("mscale_all_dim") or 0)
    if kind == "default" or not all_dim:
        return 1.0
    return yarn_mscale(float(scaling.get("factor") or 1), all_dim) ** 2


def deepseek_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a dense one below first_k_dense_replace, else routed plus shared experts."""
    if not config.is_moe_layer(layer):
        return MLP(config)
    c = config
    router = GroupLimitedRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
                                c.norm_topk_prob, c.routed_scaling_factor, c.topk_method)
    shared = MLP(c, intermediate=c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None
    return SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                          c.norm_topk_prob, c.expert_slots or None, layer, router=router, shared=shared)


def deepseek_model(config: ModelConfig) -> LlamaForCausalLM:
    """The registry's constructor for DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""
    return LlamaForCausalLM(config, mlp_for_layer=deepseek_mlp, attention_for_layer=MLAttention)

