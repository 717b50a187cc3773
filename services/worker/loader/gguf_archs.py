"""What each GGUF architecture (`general.architecture`) is in the model registry: the HF
architecture it builds, its tensor names, the layouts llama.cpp's converter changed, and the
ModelConfig fields its metadata sets beyond the Llama ones (gguf_loader reads those).

llama.cpp's conventions (convert_hf_to_gguf.py, gguf-py's tensor names and keys):
- `llama` (Llama, Mistral, SmolLM2): Q/K rows permuted (its RoPE pairs adjacent dims, HF pairs
  dim i with i + head_dim/2); every other architecture keeps HF's NeoX-style rows. A
  `llama.attention.sliding_window` is Mistral's window. A `llama` with experts is Mixtral: refused.
- `qwen3`, `qwen3moe`: per-head `attn_q_norm` / `attn_k_norm`; qwen3moe stacks each layer's
  experts ([E, I, H] `ffn_gate_exps` / `ffn_up_exps`, [E, H, I] `ffn_down_exps`) beside the router
  `ffn_gate_inp`, and llama.cpp renormalizes the top-k weights unless `expert_weights_norm` says no.
- `phi3`: q/k/v fused as `attn_qkv`, and gate/up fused as `ffn_up` ([gate; up] rows, no
  `ffn_gate`); a sliding window of 0 means none; LongRoPE comes as `rope_factors_long/short`.
- `gemma2`: norm weights stored as 1 + w (the converter adds the 1 Gemma's RMSNorm would);
  `ffn_norm` is the pre-feed-forward norm, `post_attention_norm` / `post_ffw_norm` the two
  post-norms; the LM head is the embedding; layers 0, 2, 4, ... slide; llama.cpp scales the
  attention by head_dim ** -0.5, except for the 27B (46 layers) by (hidden / heads) ** -0.5.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from services.worker.model.config import ModelConfig
from services.worker.model.mistral import effective_window

Key = Callable[..., Any]  # key("expert_count", default) → metadata `{arch}.expert_count`

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # GGUF layer tensor suffix → HF suffix, for every architecture
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_EXPERTS = {  # stacked experts; gate and up are joined into experts.gate_up_proj by stack_experts
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GEMMA2_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused tensors: GGUF suffix → (HF suffixes of its row blocks, their row counts).
_PHI3_FUSED: dict[str, tuple[tuple[str, ...], Callable[[ModelConfig], tuple[int, ...]]]] = {
    "attn_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                        lambda c: (c.q_size, c.kv_size, c.kv_size)),
    "ffn_up.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                      lambda c: (c.intermediate_size, c.intermediate_size)),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _window(value: Any, context: int) -> int | None:
    """A GGUF sliding window (0 or absent: none) as ModelConfig.sliding_window."""
    return effective_window({"sliding_window": int(value) if value else None, "max_position_embeddings": context})


def _llama(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    experts = key("expert_count")
    if experts or any(n.endswith(".ffn_gate_inp.weight") for n in names):
        # llama.cpp's converter writes Mixtral as `llama` plus experts; only its HF directory loads
        raise ValueError(f"a llama GGUF with experts (Mixtral; expert_count={experts}) is not supported; "
                         "load the model's Hugging Face directory (MixtralForCausalLM) instead")
    return {"sliding_window": _window(key("attention.sliding_window"), c.max_position_embeddings)}


def _qwen3(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    return {"qk_norm": True}


def _qwen3_moe(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    experts, used, inter = key("expert_count"), key("expert_used_count"), key("expert_feed_forward_length")
    if experts is None or used is None or inter is None:
        raise ValueError("incomplete qwen3moe GGUF: expert_count, expert_used_count and "
                         "expert_feed_forward_length are required")
    if not 1 <= int(used) <= int(experts):
        raise ValueError(f"expert_used_count={used} must be within 1 .. expert_count={experts}")
    gating = key("expert_gating_func", 1)
    if int(gating) != 1:
        raise ValueError(f"expert_gating_func={gating} is not supported (only 1: softmax)")
    dense = tuple(i for i in range(c.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return {"qk_norm": True, "num_experts": int(experts), "num_experts_per_tok": int(used),
            "moe_intermediate_size": int(inter), "norm_topk_prob": bool(key("expert_weights_norm", True)),
            "mlp_only_layers": dense}


def _phi3(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    if any(n.startswith("rope_factors_") for n in names):
        raise ValueError("Phi-3 LongRoPE (rope_factors_long/short) is not supported; only plain RoPE "
                         "(the 4k-context Phi-3 models) is")
    rot = key("rope.dimension_count")
    if rot is not None and int(rot) != c.head_dim:
        raise ValueError(f"Phi-3 rope.dimension_count={rot} is not supported (only head_dim {c.head_dim})")
    return {"sliding_window": _window(key("attention.sliding_window"), c.max_position_embeddings)}


def _gemma2(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    if "output.weight" in names:
        raise ValueError("Gemma 2 with an untied LM head (output.weight) is not supported")
    n = c.num_hidden_layers
    scale = key("attention.scale")  # not written by llama.cpp's converter; honoured when a file has it
    if scale:
        query_pre_attn_scalar = float(scale) ** -2
    else:
        query_pre_attn_scalar = c.hidden_size / c.num_attention_heads if n == 46 else float(c.head_dim)
    return {"sliding_window": _window(key("attention.sliding_window", 4096), c.max_position_embeddings),
            "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)),
            "query_pre_attn_scalar": query_pre_attn_scalar,
            "attn_logit_softcapping": float(key("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(key("final_logit_softcapping", 30.0)),
            "tie_word_embeddings": True}


def _no_fields(key: Key, names: set[str], c: ModelConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFArch:
    architecture: str  # the model registry's HF name (services/worker/model/registry.py)
    permute_qk: bool = False  # llama.cpp permuted the Q/K rows (see the module docstring)
    norm_offset: float = 0.0  # the file stores norm weights as norm_offset + w (Gemma: 1)
    layer_names: dict[str, str] = field(default_factory=dict)  # over and beside _LAYER_NAMES
    fused: dict = field(default_factory=dict)  # GGUF suffix → (HF suffixes, row counts(config)), split on load
    # (key, tensor names, the Llama-field config) → ModelConfig fields; ValueError for what is not computed
    config_fields: Callable[[Key, set[str], ModelConfig], dict[str, Any]] = _no_fields
    moe: bool = False  # feed_forward_length optional (dense layers only); experts stacked by stack_experts


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", permute_qk=True, config_fields=_llama),
    "qwen2": GGUFArch("Qwen2ForCausalLM"),  # q/k/v biases are detected from the tensors present
    "qwen3": GGUFArch("Qwen3ForCausalLM", layer_names=_QK_NORM, config_fields=_qwen3),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", layer_names={**_QK_NORM, **_EXPERTS}, config_fields=_qwen3_moe,
                         moe=True),
    "phi3": GGUFArch("Phi3ForCausalLM", fused=_PHI3_FUSED, config_fields=_phi3),
    "gemma2": GGUFArch("Gemma2ForCausalLM", norm_offset=1.0, layer_names=_GEMMA2_NORMS, config_fields=_gemma2),
}


def permute_heads(arch: GGUFArch, gguf_name: str, config: ModelConfig) -> int | None:
    """Number of heads to un-permute for this tensor, or None when it is stored in HF layout."""
    if not arch.permute_qk:
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def hf_tensors(arch: GGUFArch, gguf_name: str, values: np.ndarray, blocks: np.ndarray | None,
               config: ModelConfig, path: str) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """One GGUF tensor (float32 values in HF row order, and its quantized rows or None) → the HF
    tensors it holds: [(HF name, values, blocks)], split where the file fused them."""
    if arch.norm_offset and gguf_name.endswith("norm.weight"):
        values = values - np.float32(arch.norm_offset)
    if gguf_name in GLOBAL_NAMES:
        return [(GLOBAL_NAMES[gguf_name], values, blocks)]
    m = _LAYER_RE.fullmatch(gguf_name)
    suffix = m.group(2) if m else None
    prefix = f"model.layers.{m.group(1)}." if m else ""
    if suffix in arch.fused:
        names, rows = arch.fused[suffix]
        sizes = rows(config)
        if sum(sizes) != values.shape[0]:
            raise ValueError(f"{path}: {gguf_name} has {values.shape[0]} rows, expected {sum(sizes)}")
        cuts = np.cumsum(sizes)[:-1]
        parts = np.split(values, cuts)
        raw = np.split(blocks, cuts) if blocks is not None else [None] * len(names)
        return [(prefix + n, np.ascontiguousarray(v), None if b is None else np.ascontiguousarray(b))
                for n, v, b in zip(names, parts, raw)]
    hf = arch.layer_names.get(suffix) or _LAYER_NAMES.get(suffix)
    if hf is None:
        raise ValueError(f"{path}: tensor {gguf_name!r} has no Hugging Face {arch.architecture} counterpart")
    return [(prefix + hf, values, blocks)]


def stack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """In place: each layer's stacked experts.gate_proj / up_proj [E, I, H] → experts.gate_up_proj
    [E, 2I, H] ([gate; up] rows, transformers' in-memory layout that moe.SparseMoeBlock loads)."""
    for gate_name in [n for n in tensors if n.endswith("mlp.experts.gate_proj")]:
        up_name = gate_name.removesuffix("gate_proj") + "up_proj"
        if up_name not in tensors:
            raise ValueError(f"{gate_name} has no {up_name} beside it (ffn_gate_exps without ffn_up_exps)")
        gate, up = tensors.pop(gate_name), tensors.pop(up_name)
        tensors[gate_name.removesuffix("gate_proj") + "gate_up_proj"] = torch.cat([gate, up], dim=1)
