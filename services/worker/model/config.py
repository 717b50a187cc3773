"""The model configuration every loader produces and the model consumes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder hyper-parameters (Llama 2/3, SmolLM2, Qwen2/3, Phi-3, Mistral, Gemma 2,
    Qwen3-MoE).

    Field names follow Hugging Face's `LlamaConfig` so that `from_hf_dict`
    is a plain projection of a `config.json`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    # Mistral, Phi-3: each query attends to the last sliding_window positions (itself included); None = all.
    sliding_window: int | None = None
    # Gemma 2: per layer "sliding_attention" (uses sliding_window) or "full_attention"; () = every
    # layer alike (all windowed when sliding_window is set).
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None  # Gemma 2: attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores → c * tanh(scores / c)
    final_logit_softcapping: float | None = None  # Gemma 2: logits → c * tanh(logits / c)
    # Mixture of experts (Qwen3-MoE): num_experts 0 = dense MLPs only. Layer i is sparse when it is
    # not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (is_moe_layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The experts' weight slots a sparse block holds: 0 = one per expert; an expert-parallel rank's
    # model holds only its physical experts (services/worker/parallel/expert_parallel.py).
    expert_slots: int = 0
    # DeepSeek MoE (deepseek.py, group_router.py): topk_method "" is the plain softmax top-k router
    # (Qwen, Mixtral); a DeepSeek one picks with n_group groups of which topk_group are eligible: "noaux_tc" (V3: sigmoid scores plus a correction bias for the choice),
    # "greedy" / "group_limited_greedy" (V2: softmax); the chosen weights times
    # routed_scaling_factor; n_shared_experts always-on experts as one dense MLP of
    # n_shared_experts * moe_intermediate_size beside them.
    topk_method: str = ""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # MLA (Multi-head Latent Attention, DeepSeek-V2/V3; mla.py): kv_lora_rank 0 = not MLA. The KV
    # cache holds, per token and layer, one latent row of kv_lora_rank + qk_rope_head_dim elements
    # (kv_pool.KVPoolSpec.latent_dim); queries are qk_nope_head_dim + qk_rope_head_dim per head,
    # values v_head_dim; q_lora_rank None: q is one projection (V2-Lite), else a low-rank pair
    # with an RMSNorm between. head_dim is qk_rope_head_dim (the RoPE tables' width).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's RoPE rows in (x0, x1) pairs (mla.py reorders them)
    # 1 / sqrt(qk head dim), times YaRN's mscale squared where rope_scaling asks for it; None: the
    # backend's head_dim ** -0.5.
    attention_scale: float | None = None
    # The HF `architectures` name the model registry builds (services/worker/model/registry.py).
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be a positive number of positions")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: it attends to every earlier position)."""
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (the Llama fields; the model registry's
        per-architecture fields are set by the HF loader)."""
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        archs = d.get("architectures") or []
        is_qwen2 = d.get("model_type") == "qwen2" or any("Qwen2" in a for a in archs)
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers >= 5 nests these
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if is_qwen2 else 1e-5),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", is_qwen2)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
