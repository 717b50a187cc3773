"""Multi-head Latent Attention (DeepSeek-V2/V3), in the absorbed form, over a latent KV pool.

MLA compresses each token's keys and values into one latent row: c = RMSNorm(W_DKV x) of
kv_lora_rank elements, plus a decoupled RoPE key k_pe of qk_rope_head_dim shared by every head.
The checkpoint's kv_b_proj expands c into each head's k_nope and v. Absorbed, nothing is
expanded: W_UK moves onto the query side (q_nope W_UK is a query in the latent space) and W_UV
onto the output (attention's output in the latent space, then W_UV per head), so every head
attends MQA-style over the same cached row [c, k_pe]:

    score(h, j) = q_nope[h] . (W_UK[h] c_j) + q_pe[h] . k_pe_j = [q_nope[h] W_UK[h], q_pe[h]] . [c_j, k_pe_j]
    out[h]      = W_UV[h] sum_j p(h, j) c_j

The pool stores kv_lora_rank + qk_rope_head_dim elements per token and layer (one KV head,
KVPoolSpec.latent_dim), and the backend reads V as the row's first kv_lora_rank columns. The same
form runs prefill and decode: it is exact algebra, so the logits equal transformers' expanded
form up to float rounding.

Weights keep transformers' names, except kv_b_proj, which fuse_hf splits into the two absorbed
matrices w_kc [H, qk_nope_head_dim, kv_lora_rank] and w_vc [H, v_head_dim, kv_lora_rank]. With
rope_interleave (the V3 default), the checkpoint's RoPE rows hold (x0, x1), (x2, x3) ... pairs;
fuse_hf reorders them to the rotate-half layout (evens, then odds) in q's and k_pe's projections
alike, so the RoPE the layer ops apply is the plain one and every q_pe . k_pe is unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.layer_attention import LayerAttention
from services.worker.model.layer_ops import LayerOps
from services.worker.model.linear import Linear
from services.worker.model.rope import RotaryEmbedding

LORA_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep their default epsilon


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.heads, self.rank = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qk = self.nope + self.rope_dim
        if c.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = _Norm(c.q_lora_rank)
            self.q_b_proj = Linear(c.q_lora_rank, self.heads * qk, bias=False)
        else:
            self.q_proj = Linear(c.hidden_size, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope_dim, bias=c.attention_bias)
        self.kv_a_layernorm = _Norm(self.rank)
        self.w_kc = nn.Parameter(torch.empty(self.heads, self.nope, self.rank))  # W_UK per head
        self.w_vc = nn.Parameter(torch.empty(self.heads, self.v_dim, self.rank))  # W_UV per head
        self.o_proj = Linear(self.heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.variant = LayerAttention(c.attention_scale or qk ** -0.5)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, meta, ops: LayerOps) -> torch.Tensor:
        # x [T, hidden]
        T, H, R = x.shape[0], self.heads, self.rank
        q = self._query(x, ops).view(T, H, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)  # [T, H, nope], [T, H, rope]
        latent = self.kv_a_proj_with_mqa(x)  # [T, R + rope]
        c = ops.rms_norm(latent[:, :R].contiguous(), self.kv_a_layernorm.weight, LORA_NORM_EPS)  # [T, R]
        cos, sin = rope.cos[meta.positions], rope.sin[meta.positions]  # [T, rope]
        q_pe = _rotate(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))
        k_pe = _rotate(latent[:, R:], cos, sin)  # [T, rope]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)  # [T, H, R]
        q_full = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)  # [T, H, R + rope]
        k_full = torch.cat([c, k_pe.to(c.dtype)], dim=-1).unsqueeze(1)  # [T, 1, R + rope]
        out = meta.attention(self.layer_id, q_full, k_full, k_full[..., :R], self.variant)  # [T, H, R]
        out = torch.bmm(out.transpose(0, 1), self.w_vc.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(T, H * self.v_dim))

    def _query(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden] → q [T, H (nope + rope)]: one projection, or the low-rank pair."""
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(ops.rms_norm(self.q_a_proj(x), self.q_a_layernorm.weight, LORA_NORM_EPS))

    def fuse_hf(self, t: dict[str, torch.Tensor], prefix: str, rope_interleave: bool) -> dict[str, torch.Tensor]:
        """Pop kv_b_proj under prefix ("layers.3.self_attn.") → {w_kc, w_vc}; with
        rope_interleave, reorder the RoPE rows of q's projection and of kv_a_proj_with_mqa in
        place in `t` (a tensor held only as quantized blocks is not reordered: refused earlier)."""
        out = {}
        kv_b = t.pop(f"{prefix}kv_b_proj.weight", None)  # [H (nope + v), R]
        if kv_b is not None:
            per_head = kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
            out[f"{prefix}w_kc"], out[f"{prefix}w_vc"] = (w.contiguous() for w in
                                                          per_head.split([self.nope, self.v_dim], dim=1))
        if rope_interleave:
            q_name = f"{prefix}{'q_proj' if self.q_proj is not None else 'q_b_proj'}.weight"
            if q_name in t:
                t[q_name] = _deinterleave_rows(t[q_name], self.heads, self.nope + self.rope_dim, self.nope)
            for suffix in ("weight", "bias"):
                name = f"{prefix}kv_a_proj_with_mqa.{suffix}"
                if name in t:
                    t[name] = _deinterleave_rows(t[name], 1, self.rank + self.rope_dim, self.rank)
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [..., rope] with cos, sin broadcastable → x's shape, float32 math."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _deinterleave_rows(w: torch.Tensor, groups: int, width: int, first: int) -> torch.Tensor:
    """w's rows as `groups` blocks of `width`, each block's rows from `first` on reordered
    evens then odds (interleaved RoPE pairs → rotate-half halves); w [groups * width, ...] or a bias."""
    rope = width - first
    order = torch.cat([torch.arange(first), first + torch.arange(0, rope, 2), first + torch.arange(1, rope, 2)])
    blocks = w.reshape(groups, width, *w.shape[1:])
    return blocks.index_select(1, order).reshape(w.shape)


def drop_mtp_layers(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint without its MTP layers (layers.{num_hidden_layers}.. : the NEXTN drafter's)."""
    first = config.num_hidden_layers
    return {n: t for n, t in tensors.items() if not _layer_at_least(n, first)}


def _layer_at_least(name: str, first: int) -> bool:
    parts = name.removeprefix("model.").split(".")
    return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= first
