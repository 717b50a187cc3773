"""The multi-token-prediction (MTP) layer a checkpoint ships beside its decoder, as a NEXTN draft head.

DeepSeek-V3's layout (config.json `num_nextn_predict_layers: 1`): the MTP layer's tensors are
`model.layers.{L}.*`, L = num_hidden_layers, in the target's own safetensors:
  enorm, hnorm [H]; eh_proj [H, 2H]; a decoder layer of the target's kind (here Llama-style:
  input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj);
  shared_head.norm [H]; optionally shared_head.head [V, H] and embed_tokens [V, H] (copies of the
  target's: SGLang skips both and uses the target's, and so do we, the own head only when the
  target's is not held dense).
Math, for the entry at position p (target feature at p, token p + 1, predicts token p + 2):
  x      = eh_proj(cat(enorm(embed(token p + 1)), hnorm(hidden p)))   [n, H]
  h      = x + o_proj(attn(input_layernorm(x)))                        pre-norm, residual
  out    = shared_head.norm(h + mlp(post_attention_layernorm(h)))     [n, H]
  logits = lm_head(out)
Which hidden state, as read in SGLang (python/sglang/srt/models/deepseek_nextn.py and the logits
processor): the MTP layer reads `spec_info.hidden_states`, what the target's logits processor
captured, and the target hands that processor its hidden states AFTER its final norm; the MTP
layer's own output is likewise returned after shared_head.norm and captured as the next draft
step's hidden. So `fuse` applies the target's final norm to our capture L (the stream before
that norm; load_nextn_head reads `model.norm.weight` from the same checkpoint) and `step`
returns the normed `out` as out_hidden, fed back as the next step's `hidden` (hnorm then
normalises an already-normed state: that is what the layer was trained on).
Limits: the head's RoPE is plain (no rope_scaling), its decoder layer dense Llama (no MLA, MoE,
biases or q/k norm: refused by name). A mismatch in RoPE costs acceptance only, never output:
the target verifies every draft.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.speculative.eagle_head import (HeadKV, RMSNorm, _Attention, _MLP, default_attend, head_attention,
                                                   needs_mask)

log = logging.getLogger(__name__)

NO_MTP = ("this checkpoint ships no MTP layer (DeepSeek's layout: config.json num_nextn_predict_layers and "
          "tensors model.layers.{L}.*): use --speculative-algorithm EAGLE3 with a trained head")


@dataclass
class NextNConfig:
    """The MTP layer's sizes (the target's own) and the fields EagleDrafter reads from a head config."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    capture_layers: tuple[int, ...]  # (L,): the target's last residual stream, before its final norm
    eagle3: bool = False  # no fc, no draft vocabulary: the drafter treats it as EAGLE (v1)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, d: dict, num_target_layers: int, rope_theta: float) -> "NextNConfig":
        """The target's config.json (as a dict) -> config; KeyError for a missing size."""
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        return cls(hidden_size=hidden, intermediate_size=d["intermediate_size"], num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or hidden // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=rope_theta, vocab_size=d["vocab_size"], capture_layers=(num_target_layers,))


class _SharedHead(nn.Module):
    def __init__(self, c: NextNConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class NextNHead(nn.Module):
    """Parameter names are the checkpoint's, less the `model.layers.{L}.` prefix. The target's
    embedding, LM head and final-norm weight are buffers, never saved."""

    def __init__(self, config: NextNConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 target_norm: torch.Tensor):
        """embed_tokens, lm_head [V, H]; target_norm [H]: the target's final norm weight."""
        super().__init__()
        c = self.config = config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)
        self.shared_head = _SharedHead(c)
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.register_buffer("target_norm", target_norm, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (its norms'; its linears may hold int8 copies: head_quant.py)."""
        return self.enorm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding lookup: ids [n] -> [n, H]."""
        return F.embedding(ids, self.embed_tokens).to(self.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's capture L [n, H] (before its final norm) -> the state the MTP layer reads:
        after that norm (see the module docstring). hnorm is the layer's own, applied in step."""
        xf = aux.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (normed * self.target_norm.float()).to(self.dtype)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: HeadKV,
             attend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [n, H] (tokens at positions + 1), hidden [n, H] (fuse's output, or a previous
        step's out_hidden), positions [n]; appends n entries to `cache`; attend [n, len(cache
        before) + n] bool (default: default_attend) -> (logits [n, V] float32, out_hidden [n, H],
        after shared_head.norm)."""
        if attend is None and needs_mask(cache.positions, positions):
            attend = default_attend(cache.positions, positions)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))  # [n, H]
        h = x + head_attention(self.self_attn, self.config, self.input_layernorm(x), positions, cache, attend)
        out = self.shared_head.norm(h + self.mlp(self.post_attention_layernorm(h)))  # [n, H]
        return (out @ self.lm_head.to(out.dtype).T).float(), out

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary is the target's."""
        return ids


def load_nextn_head(model_path: str, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None,
                    num_target_layers: int, rope_theta: float, dtype: torch.dtype = torch.float32) -> NextNHead:
    """The MTP layer of the HF checkpoint directory `model_path` (config.json + safetensors, the
    target's own) -> its head in `dtype`, drafting with the target's embed_tokens [V, H] and
    lm_head [V, H] (None: the checkpoint's shared_head.head). Reads only the MTP layer's tensors
    and model.norm.weight. ValueError naming the path for a GGUF file, a checkpoint without an
    MTP layer, one that is not this target's, or an MTP layer that is not Llama-style."""
    config, raw = _read_config(model_path, num_target_layers, rope_theta)
    vocab, hidden = embed_tokens.shape
    if (config.vocab_size, config.hidden_size) != (vocab, hidden):
        raise ValueError(f"{model_path}: the MTP layer is for vocabulary {config.vocab_size} and hidden size "
                         f"{config.hidden_size}, this target has {vocab} and {hidden}")
    if raw["num_nextn_predict_layers"] > 1:
        log.info("%s ships %d MTP layers: NEXTN drafts with the first", model_path, raw["num_nextn_predict_layers"])
    state, target_norm = _read_tensors(model_path, f"model.layers.{num_target_layers}.")
    if not state:
        raise ValueError(f"{model_path}: config.json declares num_nextn_predict_layers but the safetensors hold no "
                         f"model.layers.{num_target_layers}.* tensors; {NO_MTP}")
    if target_norm is None:
        raise ValueError(f"{model_path}: no model.norm.weight (the target's final norm, which the MTP layer's input "
                         "goes through)")
    state.pop("embed_tokens.weight", None)  # a copy of the target's
    own_head = state.pop("shared_head.head.weight", None)
    head_weight = lm_head if lm_head is not None else own_head
    if head_weight is None:
        raise ValueError(f"{model_path}: the MTP layer has no shared_head.head.weight and the target's LM head is not "
                         "held dense: nothing to compute draft logits with")
    head = NextNHead(config, embed_tokens.to(dtype), head_weight.to(dtype), target_norm.to(dtype))
    _check_state(model_path, head, state)
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return head.to(dtype)


def _read_config(model_path: str, num_target_layers: int, rope_theta: float) -> tuple[NextNConfig, dict]:
    if os.path.isfile(model_path) and (model_path.endswith(".gguf") or _is_gguf(model_path)):
        raise ValueError(f"{model_path} is a GGUF file: NEXTN reads the MTP layer from a Hugging Face directory "
                         "(config.json + safetensors); GGUF targets: use --speculative-algorithm EAGLE3 or STANDALONE")
    cfg_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{model_path}: NEXTN reads the MTP layer from a Hugging Face directory with config.json")
    with open(cfg_file, encoding="utf-8") as f:
        raw = json.load(f)
    if not raw.get("num_nextn_predict_layers"):
        raise ValueError(f"{model_path}: {NO_MTP}")
    if raw.get("num_hidden_layers") != num_target_layers:
        raise ValueError(f"{model_path} has {raw.get('num_hidden_layers')} layers, the target {num_target_layers}: "
                         "NEXTN reads the target's own checkpoint")
    try:
        return NextNConfig.from_dict(raw, num_target_layers, rope_theta), raw
    except KeyError as e:
        raise ValueError(f"{cfg_file} lacks {e.args[0]!r}") from None


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_tensors(model_path: str, prefix: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The tensors under `prefix` (prefix stripped) and model.norm.weight, from every shard."""
    from safetensors import safe_open

    from services.worker.loader.hf_loader import _shards
    try:
        shards = _shards(model_path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    state, norm = {}, None
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix) and "rotary_emb" not in name:
                    state[name.removeprefix(prefix)] = f.get_tensor(name)
                elif name == "model.norm.weight":
                    norm = f.get_tensor(name)
    return state, norm


def _check_state(model_path: str, head: NextNHead, state: dict[str, torch.Tensor]) -> None:
    """ValueError listing missing, unexpected and misshapen tensors (a DeepSeek MLA / MoE layer
    shows as unexpected names: named as such)."""
    want = head.state_dict()
    unexpected = [k for k in state if k not in want]
    problems = [f"missing {k}" for k in want if k not in state] + [f"unexpected {k}" for k in unexpected]
    problems += [f"{k} has shape {list(state[k].shape)}, expected {list(v.shape)}"
                 for k, v in want.items() if k in state and state[k].shape != v.shape]
    if not problems:
        return
    kind = ""
    if any("kv_a_proj" in k or "q_a_proj" in k or "kv_b_proj" in k for k in unexpected):
        kind = " (its attention is DeepSeek's MLA, not supported: NEXTN needs a Llama-style MTP layer)"
    elif any("experts" in k for k in unexpected):
        kind = " (its MLP is a mixture of experts, not supported: NEXTN needs a Llama-style MTP layer)"
    raise ValueError(f"{model_path}: the MTP layer model.layers.{head.config.capture_layers[0]}.* does not match a "
                     f"Llama-style layer of this target{kind}: {'; '.join(problems[:6])}")
