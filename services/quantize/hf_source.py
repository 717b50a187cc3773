"""An HF Llama directory as the GGUF tensors and metadata llama.cpp's convert_hf_to_gguf.py would
write for it (F32, before re-encoding): GGUF names, Q/K rows permuted to llama.cpp's RoPE layout,
the architecture keys, and a byte-level BPE vocabulary (with merges, special ids and the chat
template) when the directory's tokenizer.json holds one."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import gguf
import numpy as np

log = logging.getLogger(__name__)
_LAYER = {  # HF suffix after model.layers.{i}. → GGUF suffix after blk.{i}.
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def read_config(src: str) -> dict:
    """config.json of a plain Llama (no RoPE scaling, no biases); ValueError naming the way out otherwise."""
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    scaling = raw.get("rope_scaling") or {k: v for k, v in (raw.get("rope_parameters") or {}).items()
                                          if k == "rope_type" and v != "default"}
    if raw.get("model_type") != "llama" or scaling or raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{src}: radixmesh quantize converts plain Llama HF checkpoints (model_type llama, no "
                         "RoPE scaling or biases); convert others with llama.cpp's convert_hf_to_gguf.py, then "
                         "requantize the GGUF here")
    return raw


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's Q/K rows → llama.cpp's (its RoPE rotates adjacent pairs; our GGUF loader undoes this)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(src: str, raw: dict) -> dict[str, np.ndarray]:
    """GGUF name → float32 array (numpy shape: rows last) of every tensor."""
    from services.worker.loader.hf_loader import load_hf_dir
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
    out: dict[str, np.ndarray] = {}
    for name, t in load_hf_dir(src).tensors.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not raw.get("tie_word_embeddings", False):
                out["output.weight"] = a
        else:
            _, _, i, suffix = name.split(".", 3)
            if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                a = _permute(a, heads if "q_proj" in suffix else kv_heads)
            out[f"blk.{i}.{_LAYER[suffix]}"] = np.ascontiguousarray(a)
    return out


def add_metadata(writer: gguf.GGUFWriter, src: str, raw: dict) -> None:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    writer.add_name(os.path.basename(os.path.normpath(src)))
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(raw.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(raw.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base((raw.get("rope_parameters") or {}).get("rope_theta") or raw.get("rope_theta", 10000.0))
    writer.add_vocab_size(raw["vocab_size"])
    _add_vocab(writer, src, raw["vocab_size"])


def _add_vocab(writer: gguf.GGUFWriter, src: str, n_vocab: int) -> None:
    try:
        vocab = gguf.vocab.BpeVocab(Path(src))
    except FileNotFoundError:
        log.warning("%s has no byte-level BPE tokenizer.json: the GGUF gets no vocabulary (give the server "
                    "the tokenizer another way)", src)
        return
    tokens, types = [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text if isinstance(text, bytes) else str(text).encode("utf-8"))
        types.append(kind)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.vocab.SpecialVocab(src, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
