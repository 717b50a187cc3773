"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a paged KV pool.

The model never sees requests: it takes a flat token batch and one
`ForwardMeta` owned by the runner, and reaches KV only through the attention
backend. Projections are fused (qkv, gate_up) so each layer runs a few large
matmuls for the whole batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 (as the reference does), scale in the model dtype.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return self.weight * normed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, meta) -> torch.Tensor:
        # x [T, hidden]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(meta.positions, q, k)
        out = meta.attention(self.layer_id, q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → logits [len(logits_indices), vocab] (float32).

        Only the rows that are sampled go through the LM head: a prefill chunk
        of 2,000 tokens needs one row of logits, not 2,000.
        """
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rope, meta)
        x = self.norm(x[logits_indices])
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on missing or
        unexpected names so a wrong checkpoint never half-loads silently."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(own[name].shape)}")
            with torch.no_grad():
                own[name].copy_(value)
            loaded.add(name)

        t = {k.removeprefix("model."): v for k, v in tensors.items() if "rotary_emb" not in k}
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            for suffix in ("weight", "bias"):
                parts = [t.pop(f"{p}self_attn.{n}_proj.{suffix}", None) for n in "qkv"]
                if all(x is not None for x in parts):
                    put(f"{p}self_attn.qkv_proj.{suffix}", torch.cat(parts, 0))
            gate, up = t.pop(f"{p}mlp.gate_proj.weight"), t.pop(f"{p}mlp.up_proj.weight")
            put(f"{p}mlp.gate_up_proj.weight", torch.cat([gate, up], 0))
        if "lm_head.weight" in t and self.lm_head is not None:
            put("lm_head.weight", t.pop("lm_head.weight"))
        t.pop("lm_head.weight", None)  # tied: identical to the embedding
        for name, value in t.items():
            put(name, value)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} missing)")
