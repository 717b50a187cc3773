"""Gemma 2 (Gemma2ForCausalLM): llama.py's attention and gated MLP, composed differently.

- embeddings scaled by sqrt(hidden_size); the LM head is tied to them;
- every RMSNorm scales by (1 + w) (the checkpoint stores w around 0);
- four norms per layer: input, post-attention (on the attention output, before the residual
  add), pre-feed-forward and post-feed-forward (on the MLP output, before the add);
- GeGLU MLP: gelu (tanh approximation) of the gate times up;
- attention scale query_pre_attn_scalar ** -0.5, scores soft-capped c * tanh(s / c) with
  c = attn_logit_softcapping, and the final logits with final_logit_softcapping;
- layer_types: "sliding_attention" layers see the last sliding_window positions, the others
  all (transformers' default: layers 0, 2, 4, ... slide, 1, 3, 5, ... are full).

Each layer hands the attention backend its LayerAttention (scale, window, soft-cap). The native
paged decode kernel has neither window nor soft-cap and the one-call decode stack computes none
of this, so both are declined: the torch backend's gather + masked attention runs every step.
Refused: an activation other than gelu_pytorch_tanh, use_bidirectional_attention, an untied head.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.layer_attention import LayerAttention
from services.worker.model.layer_ops import LayerOps, TorchLayerOps
from services.worker.model.linear import Linear
from services.worker.model.llama import MLP, Attention, load_decoder_tensors, prepack_linears, unpack_linears
from services.worker.model.mistral import effective_window
from services.worker.model.rope import RotaryEmbedding


def gemma2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json → the ModelConfig fields Gemma 2 sets beyond the Llama ones."""
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 2 hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 2 use_bidirectional_attention is not supported (causal attention only)")
    if not raw.get("tie_word_embeddings", True):
        raise ValueError("Gemma 2 with an untied LM head (tie_word_embeddings false) is not supported")
    n = raw["num_hidden_layers"]
    types = tuple(raw.get("layer_types") or
                  ("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)))
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != n or unknown:
        raise ValueError(f"Gemma 2 layer_types {list(types)} must name {n} layers, each "
                         "'sliding_attention' or 'full_attention'")
    window = effective_window({**raw, "sliding_window": raw.get("sliding_window", 4096)})
    return {"sliding_window": window, "layer_types": types,
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
            "attn_logit_softcapping": _cap(raw, "attn_logit_softcapping", 50.0),
            "final_logit_softcapping": _cap(raw, "final_logit_softcapping", 30.0),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "tie_word_embeddings": True}


def _cap(raw: dict[str, Any], key: str, default: float) -> float | None:
    value = raw.get(key, default)
    return None if value is None else float(value)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight); the math is the layer ops'."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight  # [dim]


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        variant = LayerAttention(config.query_pre_attn_scalar ** -0.5, config.layer_window(layer_id),
                                 config.attn_logit_softcapping)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Attention(config, layer_id, variant)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = MLP(config, activation="gelu_tanh")
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding, meta,
                ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (x', residual'), the stream residual + x summed lazily as in llama.py.
        x [T, hidden]; residual None = first layer."""
        eps = self.input_layernorm.eps
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.scale(), eps)
        h = ops.rms_norm(self.self_attn(h, rope, meta, ops), self.post_attention_layernorm.scale(), eps)
        h, residual = ops.add_rms_norm(h, residual, self.pre_feedforward_layernorm.scale(), eps)
        return ops.rms_norm(self.mlp(h, ops), self.post_feedforward_layernorm.scale(), eps), residual


class Gemma2ForCausalLM(nn.Module):
    """The runner's model interface (llama.LlamaForCausalLM's), without the decode stack or
    quantized blocks."""

    decode_stack = None
    decode_stack_rows = 0
    tensor_parallel = None  # a group rank's sums (llama.py says why)
    pipeline = None  # a pipeline stage's forward
    aux_layers: tuple[int, ...] = ()  # EAGLE-3's capture (llama.py): never on here
    aux_hidden = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        self.lm_head: Linear | None = None  # tie_lm_head()
        self.ops: LayerOps = TorchLayerOps()

    def tie_lm_head(self) -> None:
        self.lm_head = Linear.sharing(self.embed_tokens.weight)

    def prepack_weights(self) -> bool:
        return prepack_linears(self)

    def unpack_weights(self) -> None:
        unpack_linears(self)

    def use_quantized(self, quantized: dict, max_rows: int, kernel) -> int:
        """No quantized blocks: a Gemma 2 GGUF's weights are dequantized at load (the quantized
        GEMV path is wired for the Llama decoder only)."""
        return 0

    def use_decode_stack(self, kernel, team_spin_us: int = 100) -> bool:
        return False

    def decode_stack_refusal(self) -> str | None:
        return "Gemma 2 (soft-capped attention, sliding-window layers, (1 + w) norms, GeGLU)"

    def aux_capture_refusal(self) -> str | None:
        return "Gemma 2 (aux hidden states are captured by the Llama-family decoder only)"

    def set_aux_layers(self, layers: tuple[int, ...]) -> None:
        """() only: the capture is llama.py's (LlamaForCausalLM.set_aux_layers); ValueError otherwise."""
        if tuple(layers):
            raise ValueError(f"aux hidden states (EAGLE-3) are not supported with {self.aux_capture_refusal()}")

    def forward(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None):
        """input_ids [T] → soft-capped float32 logits [len(logits_indices), vocab]."""
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rope, meta, self.ops)
        if hidden_indices is not None:  # embeddings: (logits, the final norm's output of those rows)
            return self.head(x, residual, logits_indices), self.final_hidden(x, residual, hidden_indices)
        return self.head(x, residual, logits_indices)

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The last layer's (x, residual) [T, hidden] → the final norm's float32 output of rows
        `indices` (HF's last hidden state)."""
        x, _ = self.ops.add_rms_norm(x[indices], residual[indices], self.norm.scale(), self.norm.eps)
        return x.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → the first layer's input [T, hidden], scaled by sqrt(hidden)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def head(self, x: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The last layer's (x, residual) [T, hidden] → soft-capped float32 logits of the rows logits_indices."""
        x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.scale(), self.norm.eps)
        logits = self.lm_head.logits(x)  # [N, vocab] float32
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_decoder_tensors(self, tensors)
