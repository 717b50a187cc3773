"""Tensor parallelism as an addition to a plain model: shard its config and checkpoint, then
let a few hooks sum and gather across the group. No model class has a parallel copy.

Each rank builds the registry's own class from a rank-local config (its heads, its share of
the MLP and of the vocabulary) and loads its slices of the HF-named checkpoint tensors:
- q/k/v (and a Phi-3 fused qkv) column-parallel by head; o row-parallel by the same heads.
  With more ranks than KV heads each KV head is replicated on the ranks whose query heads
  read it (tp must then be a multiple of the KV heads).
- MLA (DeepSeek-V3, model/mla.py) by head as well: q_b_proj (or q_proj) rows in head blocks of
  qk_nope + qk_rope, kv_b_proj rows in head blocks of qk_nope + v (sliced on the HF name, before
  fuse_hf splits it into w_kc and w_vc), o_proj columns in head blocks of v_head_dim. q_a_proj,
  kv_a_proj_with_mqa and the two LoRA norms are replicated, and so is the latent KV pool: every
  rank caches the same kv_lora_rank + rope row per token for its own heads to read.
- gate/up column-parallel, down row-parallel, over the intermediate size; a sparse MoE
  block's experts likewise over moe_intermediate_size (the router stays whole), and its shared
  experts (DeepSeek) over their n_shared_experts * moe_intermediate_size, like a dense MLP.
  Under expert parallelism (expert_slots) each rank holds whole experts, and the shared MLP
  whole too (the rank's moe_intermediate_size sizes both): each rank runs it on the tokens it
  owns in the dispatch (expert_parallel.token_range) and zeros on the rest, so the block's sum
  counts it once per token.
- the embedding and the LM head vocabulary-parallel: rank r holds rows [r V/tp, (r+1) V/tp)
  (the last shard padded with zero rows).
Then (install): the attention block's and the MLP block's outputs are summed over the group
(one all-reduce each per layer); the embedding looks up only its rows, zeroes the others and
is summed; the LM head's logits are gathered and cut back to the vocabulary (model.head, the
one place every path computes them). The one-call decode stack, which no hook sees into, takes
the same sums from `model.tensor_parallel` (GroupSums).

Norms, RoPE, q/k norms and the router (DeepSeek's correction bias too) are replicated. Every
rank ends a step with the same float32 logits, bit for bit, so every rank samples the same tokens.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels.quant_gemv import GROUP, QuantWeight
from services.worker.model.config import ModelConfig
from services.worker.model.mla import drop_mtp_layers
from services.worker.parallel.communicator import Communicator
from services.worker.parallel.expert_parallel import token_range


def tp_refusal(mc: ModelConfig, tp: int, ep: bool = False) -> str | None:
    """Why a model cannot be split over tp ranks (ep: its experts whole, over the same ranks), or None."""
    if tp < 1:
        return f"--tp-size must be >= 1, got {tp}"
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    if heads % tp:
        return f"--tp-size {tp} does not divide the model's {heads} attention heads"
    if not mc.is_mla and kv % tp and tp % kv:  # MLA's one latent row has no KV heads to split
        return (f"--tp-size {tp} neither divides the model's {kv} KV heads nor is a multiple of them "
                "(so KV heads cannot be split or replicated evenly)")
    if mc.intermediate_size % tp:
        return f"--tp-size {tp} does not divide the MLP's intermediate size {mc.intermediate_size}"
    if mc.num_experts and not ep and mc.moe_intermediate_size % tp:
        return f"--tp-size {tp} does not divide the experts' intermediate size {mc.moe_intermediate_size}"
    return None


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size`: which heads, MLP columns and vocabulary rows it holds.
    expert_slots: under expert parallelism (--ep-size), per decoder layer the logical experts of
    this rank's physical slots (() for a dense layer), each expert whole; () = the experts are
    split like an MLP, over their intermediate size."""
    full: ModelConfig
    rank: int
    size: int
    expert_slots: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        why = tp_refusal(self.full, self.size, self.ep)
        if why is not None:
            raise ValueError(why)

    @property
    def ep(self) -> bool:
        return bool(self.expert_slots)

    @property
    def heads(self) -> int:
        return self.full.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        """This rank's KV heads; MLA's (unused: one latent row) as its query heads, as HF configs say."""
        if self.full.is_mla:
            return self.heads
        return max(1, self.full.num_key_value_heads // self.size)

    @property
    def q_head_width(self) -> int:
        """The rows of q's projection per head: head_dim, or MLA's qk_nope + qk_rope."""
        f = self.full
        return f.qk_nope_head_dim + f.qk_rope_head_dim if f.is_mla else f.head_dim

    @property
    def o_head_width(self) -> int:
        """The input columns of o_proj per head: head_dim, or MLA's v_head_dim."""
        return self.full.v_head_dim if self.full.is_mla else self.full.head_dim

    @property
    def first_kv_head(self) -> int:
        """The full model's index of this rank's first KV head."""
        full = self.full
        if full.num_key_value_heads >= self.size:
            return self.rank * self.kv_heads
        group = full.num_attention_heads // full.num_key_value_heads  # query heads per KV head
        return self.rank * self.heads // group

    @property
    def vocab_rows(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def config(self) -> ModelConfig:
        """The model this rank builds: its heads, MLP share and vocabulary rows (an MLA model's
        latent fields whole: its pool is the full model's). Under EP the experts' size stays whole,
        and with it the shared experts' MLP (deepseek.py sizes it n_shared_experts times that)."""
        f = self.full
        if self.ep:
            experts = dict(moe_intermediate_size=f.moe_intermediate_size,
                           expert_slots=max(len(slots) for slots in self.expert_slots))
        else:
            experts = dict(moe_intermediate_size=f.moe_intermediate_size // self.size)
        return replace(f, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                       intermediate_size=f.intermediate_size // self.size, vocab_size=self.vocab_rows, **experts)

    def blocks_refusal(self) -> str | None:
        """Why a file's quantized blocks cannot be split over this group, or None: a row-parallel
        linear's input columns are cut in whole groups of 32 (the packed layout), never inside one."""
        f = self.full
        cuts = {"o_proj": self.heads * self.o_head_width, "down_proj": f.intermediate_size // self.size}
        if f.num_experts and not self.ep:
            cuts["the experts' down_proj"] = f.moe_intermediate_size // self.size
        bad = [f"{name} ({n} columns per rank)" for name, n in cuts.items() if n % GROUP]
        if bad:
            return (f"--tp-size {self.size} cuts the quantized blocks of {', '.join(bad)} inside a group of "
                    f"{GROUP} weights; use --quantization none (dense weights) or another --tp-size")
        return None

    # --- the checkpoint ------------------------------------------------------------------

    def tensors(self, full_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF name → this rank's slice, for every tensor of the full checkpoint (but DeepSeek's MTP
        layers, past the decoder's: the model never loads them, and EP places no experts for them)."""
        if self.full.is_mla:
            full_tensors = drop_mtp_layers(self.full, full_tensors)
        out: dict[str, Weight] = {}
        for name, t in _unfused(full_tensors, self.full).items():
            per_expert = _PER_EXPERT.match(name) if self.ep else None
            if per_expert:
                out.update(self._expert_copies(per_expert, t))
            else:
                out[name] = self.slice(name, t)
        return out

    def slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """One HF-named tensor → this rank's part of it (a replicated one as it is)."""
        f, D, H = self.full, self.full.head_dim, self.heads
        leaf = name.rsplit(".", 1)[-1] if name.endswith((".weight", ".bias")) else ""
        base = name.removesuffix(f".{leaf}") if leaf else name
        if base.endswith(("self_attn.q_proj", "self_attn.q_b_proj")):  # [heads * q_head_width, in]
            return _rows(t, self.rank * H * self.q_head_width, H * self.q_head_width)
        if base.endswith("self_attn.kv_b_proj"):  # MLA: [heads * (qk_nope + v), kv_lora_rank]
            width = f.qk_nope_head_dim + f.v_head_dim
            return _rows(t, self.rank * H * width, H * width)
        if base.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return _rows(t, self.first_kv_head * D, self.kv_heads * D)
        if base.endswith("self_attn.o_proj"):  # [hidden, heads * o_head_width]
            return self._row_parallel(t, leaf, self.rank * H * self.o_head_width, H * self.o_head_width)
        if ".mlp.shared_experts." in name:
            return self._shared_expert(base, leaf, t)
        if base.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return _rows(t, *self._share(f.intermediate_size))
        if base.endswith("mlp.gate_up_proj"):  # Phi-3 stores [gate; up] fused: split each half
            gate, up = _split_rows(t, [f.intermediate_size] * 2)
            return _cat_rows([_rows(gate, *self._share(f.intermediate_size)),
                              _rows(up, *self._share(f.intermediate_size))])
        if base.endswith("mlp.down_proj"):
            return self._row_parallel(t, leaf, *self._share(f.intermediate_size))
        if ".mlp.experts." in name:
            return self._whole_experts(name, t) if self.ep else self._expert(name, t)
        if base.endswith(("embed_tokens", "lm_head")):
            return _padded_rows(t, self.rank * self.vocab_rows, self.vocab_rows)
        return t

    def lora_pair(self, key: tuple[int, str], pair: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A LoRA adapter's {"A": [r, in], "B": [out, r]} of (layer, PEFT module) → this rank's part:
        a column-parallel module keeps its output rows of B, a row-parallel one (o, down) its input
        columns of A; the block's all-reduce then sums the row-parallel deltas with the rest."""
        layer, module = key
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"model.layers.{layer}.{block}.{module}.weight"
        if module in ("o_proj", "down_proj"):
            return {"A": self.slice(name, pair["A"]), "B": pair["B"]}
        return {"A": pair["A"], "B": self.slice(name, pair["B"])}

    def _shared_expert(self, base: str, leaf: str, t: Weight) -> Weight:
        """DeepSeek's shared experts, one dense MLP of n_shared_experts * moe_intermediate_size:
        split like the dense MLP, or whole under EP (install then runs it on this rank's tokens)."""
        if self.ep:
            return t
        size = self.full.n_shared_experts * self.full.moe_intermediate_size
        if base.endswith(("gate_proj", "up_proj")):  # [size, hidden]
            return _rows(t, *self._share(size))
        if base.endswith("down_proj"):  # [hidden, size]
            return self._row_parallel(t, leaf, *self._share(size))
        raise ValueError(f"tensor parallelism does not know how to split shared expert tensor {base!r}")

    def _share(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n columns or rows."""
        part = n // self.size
        return self.rank * part, part

    def _row_parallel(self, t: torch.Tensor, leaf: str, start: int, length: int) -> torch.Tensor:
        """A row-parallel linear's weight [out, in] → its input columns; a bias is added once
        (rank 0 keeps it, the others hold zeros) since the outputs are summed."""
        if leaf == "bias":
            return t if self.rank == 0 else torch.zeros_like(t)
        return _columns(t, start, length)

    def _whole_experts(self, name: str, t: Weight) -> torch.Tensor:
        """Stacked expert weights [E, ...] → [slots, ...]: the experts of this rank's slots, whole."""
        if isinstance(t, QuantWeight):
            raise ValueError("--ep-size > 1 needs the experts' weights dense: use --quantization none, or an HF "
                             "checkpoint, for expert parallelism")
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        return t.index_select(0, torch.tensor(self.expert_slots[layer])).contiguous()

    def _expert_copies(self, match, t: Weight) -> dict[str, Weight]:
        """A per-expert tensor (…layers.L.mlp.experts.E.rest) → one copy per slot of this rank that holds
        expert E, named by the slot (none when this rank holds no replica of it)."""
        prefix, layer, expert, rest = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if isinstance(t, QuantWeight):
            raise ValueError("--ep-size > 1 needs the experts' weights dense: use --quantization none, or an HF "
                             "checkpoint, for expert parallelism")
        return {f"{prefix}{slot}.{rest}": t for slot, e in enumerate(self.expert_slots[layer]) if e == expert}

    def _expert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Per-expert (experts.{e}.gate_proj ...) or stacked (experts.gate_up_proj [E, 2I, H],
        experts.down_proj [E, H, I]) expert weights → this rank's share of their intermediate size."""
        start, length = self._share(self.full.moe_intermediate_size)
        if name.endswith(("gate_proj.weight", "up_proj.weight")) and len(t.shape) == 2:
            return _rows(t, start, length)
        if name.endswith("down_proj.weight") and len(t.shape) == 2:
            return _columns(t, start, length)
        if name.endswith(("experts.gate_proj", "experts.up_proj")) and len(t.shape) == 3:  # GGUF's [E, I, H]
            return t[:, start:start + length].contiguous()
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            return torch.cat([gate[:, start:start + length], up[:, start:start + length]], 1).contiguous()
        if name.endswith("experts.down_proj"):
            return t[:, :, start:start + length].contiguous()
        raise ValueError(f"tensor parallelism does not know how to split expert tensor {name!r}")

    # --- the model ------------------------------------------------------------------------

    def install(self, model: nn.Module, comm: Communicator) -> None:
        """Make the rank's model compute its part of the full model: sums and gathers as hooks."""
        if comm.world_size != self.size or comm.rank != self.rank:
            raise ValueError(f"shard {self.rank}/{self.size} given communicator {comm.rank}/{comm.world_size}")

        def summed(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
            return comm.all_reduce(out)

        for layer in model.layers:
            layer.self_attn.register_forward_hook(summed)
            layer.mlp.register_forward_hook(summed)
            shared = getattr(layer.mlp, "shared_experts", None)
            if self.ep and shared is not None:
                _on_owned_tokens(shared, self.rank, self.size)
        _vocab_parallel_embedding(model.embed_tokens, self.rank * self.vocab_rows, comm)
        sums = GroupSums(comm, self.full.vocab_size)
        # The head's logits are gathered where every path meets (model.head): its quantized blocks
        # run in Linear.logits, which no forward hook sees.
        head = model.head
        model.head = lambda x, residual, logits_indices: sums.gather_logits(head(x, residual, logits_indices))
        model.tensor_parallel = sums  # the one-call decode stack, which no hook sees into


@dataclass(frozen=True)
class GroupSums:
    """The group's sums as the one-call decode stack takes them (LlamaForCausalLM.use_decode_stack):
    comm.all_reduce after its o and down projections, gather_logits after its LM head."""
    comm: Communicator
    vocab: int  # the full model's

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[..., vocab rows of each rank] → [..., vocab]: every rank's columns, the padding cut."""
        return self.comm.all_gather(local)[..., :self.vocab]


def _vocab_parallel_embedding(embedding: nn.Module, first_row: int, comm: Communicator) -> None:
    """Rank r's embedding holds rows [first_row, first_row + n): it looks up the ids in its range,
    zero rows for the rest, and the group sums the rows."""
    rows = embedding.weight.shape[0]
    outside: list[torch.Tensor] = []  # the mask of the call in flight: the pre-hook's, for the hook

    def local_ids(_module, inputs):
        (ids,) = inputs  # [T] int64
        local = ids - first_row
        mask = (local < 0) | (local >= rows)  # [T] bool
        outside[:] = [mask]
        return (local.masked_fill(mask, 0),)

    def summed(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(outside.pop().unsqueeze(-1), 0)  # [T, hidden]
        return comm.all_reduce(out)

    embedding.register_forward_pre_hook(local_ids)
    embedding.register_forward_hook(summed)


def _on_owned_tokens(mlp: nn.Module, rank: int, size: int) -> None:
    """Under EP: the whole shared-experts MLP runs on the tokens this rank owns in the dispatch
    (token_range) and gives zero rows for the rest, as the rank's routed output does; the block's
    all-reduce then adds each token's shared output once."""
    whole = mlp.forward

    def owned(x: torch.Tensor, ops) -> torch.Tensor:
        start, stop = token_range(x.shape[0], rank, size)  # x [T, hidden]
        out = torch.zeros_like(x)
        if stop > start:
            out[start:stop] = whole(x[start:stop], ops)
        return out

    mlp.forward = owned


# A per-expert checkpoint tensor: (….layers.L.mlp.experts.)(L)(E).(gate_proj.weight)
_PER_EXPERT = re.compile(r"^(.*\.layers\.(\d+)\.mlp\.experts\.)(\d+)\.(.*)$")

# A checkpoint tensor is a dense tensor or a file's quantized blocks (QuantWeight, from a GGUF):
# both are cut by output rows and input columns, the blocks in their packed layout.
Weight = torch.Tensor | QuantWeight


def _rows(t: Weight, start: int, length: int) -> Weight:
    if isinstance(t, QuantWeight):
        return t.row_slice(start, length)
    return t[start:start + length].contiguous()


def _columns(t: Weight, start: int, length: int) -> Weight:
    if isinstance(t, QuantWeight):
        return t.column_slice(start, length)
    return t[:, start:start + length].contiguous()


def _split_rows(t: Weight, sizes: list[int]) -> list[Weight]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_rows(t, start, n) for start, n in zip(starts, sizes)]


def _cat_rows(parts: list[Weight]) -> Weight:
    return QuantWeight.cat_rows(parts) if isinstance(parts[0], QuantWeight) else torch.cat(parts, 0)


def _padded_rows(t: Weight, start: int, length: int) -> Weight:
    """Rows [start, start + length) of t, zero rows past its end."""
    if isinstance(t, QuantWeight):
        return t.row_slice(start, length)
    part = t[start:start + length]
    if part.shape[0] == length:
        return part.contiguous()
    pad = torch.zeros((length - part.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([part, pad], 0)


def _unfused(tensors: dict[str, Weight], mc: ModelConfig) -> dict[str, Weight]:
    """A checkpoint with Phi-3's fused qkv_proj split into q/k/v (each is split by heads of its own)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".self_attn.qkv_proj." in name:
            q, k, v = _split_rows(t, [mc.q_size, mc.kv_size, mc.kv_size])
            for part, value in zip("qkv", (q, k, v)):
                out[name.replace("qkv_proj", f"{part}_proj")] = value
        else:
            out[name] = t
    return out
