"""An EAGLE / EAGLE-3 draft head, read and written in SGLang's checkpoint format.

A head is one Llama decoder layer that drafts from the target's own features instead of from
tokens alone: the entry at position p pairs the target's feature at p with the embedding of the
token at p + 1 and predicts the token at p + 2; its output ("out_hidden") is fed back as the
feature of the next draft step, so a chain of drafts needs no target forward.

EAGLE-3 (SGLang `LlamaForCausalLMEagle3`, python/sglang/srt/models/llama_eagle3.py):
  feature = fc(cat(aux at capture_layers))         [n, k * target_hidden] -> [n, H], no bias
  x       = cat(input_layernorm(embeds), hidden_norm(feature))      [n, 2H]: q/k/v take 2H
  h       = feature + o_proj(attn(x))                the residual is the un-normed feature
  out     = h + mlp(post_attention_layernorm(h))     SwiGLU; fed back as the next feature
  logits  = lm_head(norm(out))                       own lm_head over the draft vocabulary
  draft id -> target id: id + d2t[id]; t2d [V] bool marks the target ids in the draft vocab.
  config.json: "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size", and
  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}. SGLang captures the residual
  stream before decoder layer id + 1 for each id (default, no ids: before layers
  [2, L // 2, L - 3]); here capture_layers holds those layer indices directly. It must say
  "tie_word_embeddings": false, or SGLang ties lm_head to the (target-vocabulary) embedding.
EAGLE-1 (SGLang `LlamaForCausalLMEagle`, llama_eagle.py, after SafeAILab's cnets.py):
  z      = fc(cat(embeds, feature))                  [n, 2H] -> [n, H], with bias
  layer "layers.0" is a plain Llama decoder layer WITHOUT its input_layernorm (SGLang replaces
  it by the identity; a checkpoint may still carry the weight, which is ignored)
  out    = z + attn(z); out = out + mlp(post_attention_layernorm(out))
  logits = target lm_head(out)                       no final norm, the target's full vocab
  Its feature is the target's last hidden state AFTER the target's final norm (what SGLang and
  EAGLE feed it): capture_layers is (L,), the stream before that norm, so `load` takes the
  target's final-norm weight (`target_norm`) and `fuse` applies it.
Heads never store the token embedding: the target's is passed to `load` and used by `embed`.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE1_ARCH = "LlamaForCausalLMEagle"


@dataclass
class EagleHeadConfig:
    eagle3: bool
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # == vocab_size for EAGLE-1 (no d2t)
    target_hidden_size: int
    capture_layers: tuple[int, ...]  # l: the residual stream entering target layer l (l == L: before the final norm)

    @classmethod
    def from_dict(cls, d: dict, num_target_layers: int) -> "EagleHeadConfig":
        """An SGLang-format config.json (as a dict) -> config. KeyError for a missing field,
        ValueError for an unknown architecture."""
        arch = (d.get("architectures") or [None])[0]
        if arch not in (EAGLE3_ARCH, EAGLE1_ARCH):
            raise ValueError(f"architecture {arch!r} is not an EAGLE head ({EAGLE3_ARCH} or {EAGLE1_ARCH})")
        eagle3 = arch == EAGLE3_ARCH
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        n = num_target_layers
        if eagle3:
            ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            capture = tuple(i + 1 for i in ids) if ids else (2, n // 2, n - 3)
        else:
            capture = (n,)
        vocab = d["vocab_size"]
        return cls(eagle3=eagle3, hidden_size=hidden, intermediate_size=d["intermediate_size"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or hidden // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 2048), vocab_size=vocab,
                   draft_vocab_size=(d.get("draft_vocab_size") or vocab) if eagle3 else vocab,
                   target_hidden_size=d.get("target_hidden_size") or hidden, capture_layers=capture)

    def to_dict(self) -> dict:
        d = {"architectures": [EAGLE3_ARCH if self.eagle3 else EAGLE1_ARCH], "model_type": "llama",
             "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
        d.update({k: v for k, v in asdict(self).items() if k not in ("eagle3", "capture_layers")})
        if self.eagle3:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [l - 1 for l in self.capture_layers]}
        else:
            del d["draft_vocab_size"]
        return d


@dataclass
class HeadKV:
    """One request's head KV cache; entries appended in order (RoPE already applied to k).
    k, v and positions are views of the first n rows of buffers that grow by doubling, so a draft
    step appends without copying the whole cache (it runs every decode step of a long stream);
    under autograd (training) appends concatenate instead, keeping each step's graph separate."""
    k: torch.Tensor  # [n, kv_heads, head_dim]
    v: torch.Tensor  # [n, kv_heads, head_dim]
    positions: torch.Tensor  # [n] int64
    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, config: EagleHeadConfig, dtype: torch.dtype, device="cpu") -> "HeadKV":
        kv = torch.empty(0, config.num_key_value_heads, config.head_dim, dtype=dtype, device=device)
        return cls(kv, kv.clone(), torch.empty(0, dtype=torch.int64, device=device))

    def __len__(self) -> int:
        return self.positions.shape[0]

    def keep(self, n: int) -> None:
        """Drop entries n.. (a rollback after the target rejected drafts)."""
        self.k, self.v, self.positions = self.k[:n], self.v[:n], self.positions[:n]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])
            self.positions = torch.cat([self.positions, positions.to(torch.int64)])
            self._rows = None
            return
        n, m = len(self), k.shape[0]
        if self._rows is None or self._rows[0].shape[0] < n + m:
            size = max(2 * (n + m), 64)
            self._rows = tuple(torch.cat([t, t.new_empty((size - n, *t.shape[1:]))])
                               for t in (self.k, self.v, self.positions))
        kb, vb, pb = self._rows
        kb[n:n + m], vb[n:n + m], pb[n:n + m] = k, v, positions
        self.k, self.v, self.positions = kb[:n + m], vb[:n + m], pb[:n + m]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@functools.lru_cache(maxsize=8)
def _inverse_frequencies(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's 1 / theta^(2i/d), twice over (rotate-half: [d/2] then the same [d/2]) -> [d]; computed
    once (a draft step is a few dozen small ops: each counts)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    return torch.cat([inv, inv])


def rope_tables(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama RoPE's cos and sin for positions [n] -> two [n, 1, d] float32 (rotate-half layout)."""
    ang = positions.to(torch.float32)[:, None] * _inverse_frequencies(d, theta, positions.device)[None]  # [n, d]
    return ang.cos()[:, None], ang.sin()[:, None]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
         tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Llama RoPE (rotate-half): x [n, heads, d], positions [n] -> [n, heads, d] (tables: rope_tables'
    for these positions, when the caller has them)."""
    d = x.shape[-1]
    cos, sin = tables if tables is not None else rope_tables(positions, d, theta)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: EagleHeadConfig, in_size: int):
        super().__init__()
        self.q_proj = nn.Linear(in_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """The decoder layer; EAGLE-3's has input_layernorm + hidden_norm and a 2H attention input."""

    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        if c.eagle3:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, 2 * c.hidden_size if c.eagle3 else c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


def head_attention(attn: _Attention, c, x: torch.Tensor, positions: torch.Tensor, cache: HeadKV,
                   attend: torch.Tensor | None) -> torch.Tensor:
    """A head layer's attention over its own cache (EagleHead.step's, NextNHead.step's): x [n, in]
    at positions [n]; appends n entries (k after RoPE) to `cache`; attend [n, len(cache before) + n]
    bool, or None for every entry (one query after all of them) -> o_proj's output [n, H]. The g
    query heads of a KV head attend as g * n rows of it: two
    small matmuls, no copy of the cache per query head (a draft step attends one or a few rows)."""
    n, hkv, d = x.shape[0], c.num_key_value_heads, c.head_dim
    g = c.num_attention_heads // hkv
    tables = rope_tables(positions, d, c.rope_theta)
    q = rope(attn.q_proj(x).view(n, hkv, g, d).flatten(1, 2), positions, c.rope_theta, tables)
    k = rope(attn.k_proj(x).view(n, hkv, d), positions, c.rope_theta, tables)
    cache.append(k, attn.v_proj(x).view(n, hkv, d), positions)
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # [hkv, g * n, d]
    scores = torch.bmm(qg, cache.k.permute(1, 2, 0)) * d ** -0.5  # [hkv, g * n, m + n]
    if attend is not None:
        scores = scores.masked_fill(~attend.repeat(g, 1)[None], float("-inf"))
    o = torch.bmm(torch.softmax(scores.float(), -1).to(qg.dtype), cache.v.transpose(0, 1))  # [hkv, g * n, d]
    return attn.o_proj(o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, -1))


def needs_mask(cache_positions: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether default_attend masks anything: more than one new query, or one that does not come
    after every cached entry (a chain's draft step and a decode's absorb do: no mask to build)."""
    if positions.shape[0] > 1:
        return True
    return cache_positions.shape[0] > 0 and int(cache_positions[-1]) >= int(positions[0])


def default_attend(cache_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Old entries at or before each query's position, and the new ones causally by order:
    cache_positions [m] (old), positions [n] (new) -> [n, m + n] bool."""
    n = positions.shape[0]
    old = cache_positions[None, :] <= positions[:, None]
    new = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    return torch.cat([old, new], 1)


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None,
                 target_norm: torch.Tensor | None = None):
        """embed_tokens [V, T]: the target's; lm_head [V, T] and target_norm [T]: EAGLE-1 only."""
        super().__init__()
        c = self.config = config
        if c.eagle3:
            self.fc = nn.Linear(len(c.capture_layers) * c.target_hidden_size, c.hidden_size, bias=False)
            self.midlayer = _Layer(c)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        else:
            if lm_head is None:
                raise ValueError("an EAGLE-1 head drafts with the target's lm_head: pass it")
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
            self.layers = nn.ModuleList([_Layer(c)])
            self.register_buffer("target_lm_head", lm_head, persistent=False)
            self.register_buffer("target_norm", target_norm, persistent=False)
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (its norms'; its linears may hold int8 copies: head_quant.py)."""
        return self.layer.post_attention_layernorm.weight.dtype

    @property
    def layer(self) -> _Layer:
        return self.midlayer if self.config.eagle3 else self.layers[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding lookup: ids [n] -> [n, H]."""
        return F.embedding(ids, self.embed_tokens).to(self.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's captured features -> the head's input feature [n, H]. EAGLE-3: aux
        [n, len(capture_layers) * T] through fc; EAGLE-1: aux [n, H] through the target's final
        norm when `target_norm` was given (identity otherwise)."""
        aux = aux.to(self.dtype)
        if self.config.eagle3:
            return self.fc(aux)
        if self.target_norm is None:
            return aux
        xf = aux.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (normed * self.target_norm.float()).to(aux.dtype)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: HeadKV,
             attend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [n, H] (tokens at positions + 1), hidden [n, H], positions [n]; appends n entries
        to `cache`; attend [n, len(cache before) + n] bool (True: may attend; default: see
        default_attend) -> (draft logits [n, draft_vocab] float32, out_hidden [n, H])."""
        c, layer = self.config, self.layer
        if attend is None and needs_mask(cache.positions, positions):
            attend = default_attend(cache.positions, positions)
        if c.eagle3:
            x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)  # [n, 2H]
            residual = hidden
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], -1))  # [n, H]
        h = residual + head_attention(layer.self_attn, c, x, positions, cache, attend)
        out = h + layer.mlp(layer.post_attention_layernorm(h))  # [n, H]
        logits = self.lm_head(self.norm(out)) if c.eagle3 else out @ self.target_lm_head.to(out.dtype).T
        return logits.float(), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (EAGLE-1: the same)."""
        return draft_ids + self.d2t[draft_ids] if self.config.eagle3 else draft_ids

    # --- the SGLang checkpoint ---------------------------------------------------------
    @classmethod
    def load(cls, path: str, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None, num_target_layers: int,
             dtype: torch.dtype = torch.float32, device="cpu", target_norm: torch.Tensor | None = None) -> "EagleHead":
        """A directory with config.json + *.safetensors -> the head, in `dtype` on `device`.
        ValueError naming `path` for a missing file, an unknown architecture, a head whose
        sizes do not fit the target, or missing / misshapen tensors."""
        from safetensors.torch import load_file
        cfg_file = os.path.join(path, "config.json")
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not os.path.isfile(cfg_file) or not files:
            raise ValueError(f"{path}: an EAGLE head directory needs config.json and *.safetensors")
        try:
            with open(cfg_file) as f:
                config = EagleHeadConfig.from_dict(json.load(f), num_target_layers)
        except (KeyError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: bad config.json: {e}") from None
        vocab, target_hidden = embed_tokens.shape  # the head embeds with the target's table: same width
        if (config.vocab_size, config.target_hidden_size, config.hidden_size) != (vocab, target_hidden, target_hidden):
            raise ValueError(f"{path}: the head is for a target of vocabulary {config.vocab_size} and hidden size "
                             f"{config.target_hidden_size} (its own: {config.hidden_size}), this target has {vocab} "
                             f"and {target_hidden}")
        if not config.eagle3 and lm_head is None:
            raise ValueError(f"{path}: an EAGLE-1 head drafts with the target's lm_head: pass it")
        if bad := [l for l in config.capture_layers if not 0 <= l <= num_target_layers]:
            raise ValueError(f"{path}: capture layers {bad} are outside the target's {num_target_layers} layers")
        state = {}
        for f in files:
            state.update(load_file(os.path.join(path, f)))
        state.pop("embed_tokens.weight", None)  # SpecForge may save a copy of the target's
        state.pop("layers.0.input_layernorm.weight", None)  # EAGLE-1 layer 0 never uses it
        head = cls(config, embed_tokens.to(device, dtype), None if lm_head is None else lm_head.to(device, dtype),
                   None if target_norm is None else target_norm.to(device, dtype))
        want = head.state_dict()
        problems = [f"missing {k}" for k in want if k not in state]
        problems += [f"unexpected {k}" for k in state if k not in want]
        problems += [f"{k} has shape {list(state[k].shape)}, expected {list(v.shape)}"
                     for k, v in want.items() if k in state and state[k].shape != v.shape]
        if problems:
            raise ValueError(f"{path}: the tensors do not match the config: {'; '.join(problems[:6])}")
        head.load_state_dict({k: v.to(want[k].dtype) if v.is_floating_point() else v for k, v in state.items()})
        return head.to(device=device, dtype=dtype)

    def save(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """config.json + model.safetensors (SGLang tensor names), floating tensors in `dtype`."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
                 for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, "model.safetensors"))
        d = self.config.to_dict()
        d["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f, indent=2)

