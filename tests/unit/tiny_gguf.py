"""A test-side HF → GGUF writer for the tiny transformers models of tiny_models.py: what llama.cpp's
convert_hf_to_gguf.py would write for them (F32 tensors, no vocabulary), so the GGUF loader can be
checked against the same model loaded from its HF directory and against transformers.

The conventions mirrored are those services/worker/loader/gguf_archs.py documents: Q/K rows
permuted for `llama` only, Phi-3's fused attn_qkv and ffn_up, Gemma's norms stored as 1 + w,
Qwen3-MoE's stacked experts. Two keys go beyond the converter, for configs it cannot express:
`expert_weights_norm` (llama.cpp always renormalizes Qwen3-MoE's top-k) and, for a Gemma 2 whose
query_pre_attn_scalar is not the one llama.cpp derives, `attention.scale`.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "phi3": "phi3", "gemma2": "gemma2"}
_LAYER = {  # HF layer suffix → GGUF layer suffix (before the per-architecture overrides)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: [gate; up] rows in one ffn_up
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
}
_GEMMA2 = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for `llama` (its RoPE pairs adjacent dims)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(hf, arch: str) -> dict[str, np.ndarray]:
    c = hf.config
    out: dict[str, np.ndarray] = {}
    for name, t in hf.state_dict().items():
        a = t.detach().to(torch.float32).numpy().copy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # the converter stores Gemma's 1 + w
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = a
        else:
            _, _, i, suffix = name.split(".", 3)  # model.layers.{i}.suffix
            if suffix == "mlp.experts.gate_up_proj":  # [E, 2I, H] → ffn_gate_exps, ffn_up_exps [E, I, H]
                gate, up = np.split(a, 2, axis=1)
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gate.copy(), up.copy()
                continue
            if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                a = _permute(a, c.num_attention_heads if ".q_proj" in suffix else c.num_key_value_heads)
            gguf_suffix = (_GEMMA2 if arch == "gemma2" else {}).get(suffix) or _LAYER[suffix]
            out[f"blk.{i}.{gguf_suffix}"] = np.ascontiguousarray(a)
    return out


def write_gguf(hf, path: str, qtype: gguf.GGMLQuantizationType | None = None) -> str:
    """Write transformers model `hf` (a tiny_models.py config) as llama.cpp's converter would; → path.
    qtype: the type of every 2-D tensor (None: F32); 1-D and 3-D ones stay F32."""
    c = hf.config
    arch = GGUF_ARCH[c.model_type]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(theta)
    for kind in ("bos", "eos"):
        if (i := getattr(c, f"{kind}_token_id", None)) is not None:
            getattr(w, f"add_{kind}_token_id")(i)
    if arch == "llama" and getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(c.sliding_window or 0)  # 0: none (Phi-4)
    if arch == "gemma2":
        sliding = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.num_hidden_layers)]
        if list(c.layer_types) != sliding or c.attn_logit_softcapping is None or c.final_logit_softcapping is None:
            raise ValueError("llama.cpp's gemma2 has layers 0, 2, ... sliding and both soft-caps")
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        # llama.cpp scales by head_dim ** -0.5, the 27B (46 layers) by (hidden / heads) ** -0.5
        derived = c.hidden_size / c.num_attention_heads if c.num_hidden_layers == 46 else head_dim
        if c.query_pre_attn_scalar != derived:
            w.add_attention_scale(c.query_pre_attn_scalar ** -0.5)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
    for name, a in _tensors(hf, arch).items():
        if qtype is None or a.ndim != 2:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
