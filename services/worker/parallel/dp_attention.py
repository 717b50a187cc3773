"""Data-parallel attention (--enable-dp-attention --dp-size N): each rank of the group runs
attention whole, on its own requests and its own KV, under a scheduler of its own; only the MoE
layers are shared.

Under plain tensor parallelism an MLA model's one latent KV head cannot be split: every rank
holds the same latent row of every request. Here a rank holds its own requests' rows only, so
the group's KV capacity grows with its ranks (docs/parallelism.md has the table).

A rank's model: attention, the dense MLPs, the embedding and the LM head whole (nothing summed,
nothing gathered); each sparse MoE block's experts split over the group as --ep-size says (whole
experts by all-to-all, expert_parallel.py) or, with --ep-size 1, over their intermediate size.
Around each sparse block:

1. gather: every rank's tokens [t_r, hidden] → the group's batch [sum t, hidden], rank 0's first
   (the token counts are exchanged once per forward pass, the rows padded to the largest count);
2. the block runs on the whole batch exactly as under tensor parallelism (every rank routes every
   token; each computes its part; the shared experts run on the tokens a rank owns in the
   dispatch), and its output is summed over the group;
3. scatter: the rank keeps its own rows.

Every rank must meet every collective: a rank with nothing to compute while another computes runs
an idle pass (`DpTokens.idle`): zero tokens through every sparse block, in layer order. Which
ranks compute in a step is decided by the group's leader for all of them (dp_rounds.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.moe import SparseMoeBlock
from services.worker.parallel.communicator import Communicator
from services.worker.parallel.tensor_parallel import TensorShard, Weight, _on_owned_tokens

_SHARED = (".mlp.experts.", ".mlp.shared_experts.")  # the tensors a rank holds only part of


@dataclass(frozen=True)
class DpAttentionShard:
    """Rank `rank` of `size` data-parallel attention ranks: everything whole but the MoE blocks,
    which are split as a TensorShard of the same group splits them (expert_slots: under EP)."""
    full: ModelConfig
    rank: int
    size: int
    expert_slots: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.full.num_experts:
            raise ValueError(f"--enable-dp-attention: the model {self.full.architecture} has no MoE layers to share; "
                             "run --replicas N copies of it instead")
        self.moe  # sizes the experts cannot be split into raise here

    @cached_property
    def moe(self) -> TensorShard:
        return TensorShard(self.full, self.rank, self.size, self.expert_slots)

    @property
    def ep(self) -> bool:
        return bool(self.expert_slots)

    @property
    def config(self) -> ModelConfig:
        """The model this rank builds: the full one, with its share of the experts."""
        moe = self.moe.config
        return replace(self.full, moe_intermediate_size=moe.moe_intermediate_size, expert_slots=moe.expert_slots)

    def blocks_refusal(self) -> str | None:
        return None  # nothing is cut but the experts, which EP needs dense and TP cuts whole columns of

    def tensors(self, full_tensors: dict[str, Weight]) -> dict[str, Weight]:
        """HF name → this rank's tensor: the MoE blocks' parts, everything else whole."""
        shared = {n: t for n, t in full_tensors.items() if any(s in n for s in _SHARED)}
        whole = {n: t for n, t in full_tensors.items() if n not in shared}
        return {**whole, **(self.moe.tensors(shared) if shared else {})}

    def lora_pair(self, key, pair):
        raise ValueError("LoRA adapters with --enable-dp-attention are not supported yet")

    def install(self, model: nn.Module, comm: Communicator) -> None:
        """Gather before, sum and scatter after every sparse block; the idle pass on `model.dp_tokens`."""
        if comm.world_size != self.size or comm.rank != self.rank:
            raise ValueError(f"shard {self.rank}/{self.size} given communicator {comm.rank}/{comm.world_size}")
        tokens = DpTokens(comm, model)
        model.register_forward_pre_hook(lambda _m, args: tokens.exchange(args[0].shape[0]))
        for block in tokens.blocks:
            block.register_forward_pre_hook(lambda _m, args: (tokens.gather(args[0]), *args[1:]))
            block.register_forward_hook(lambda _m, _args, out: tokens.own_rows(comm.all_reduce(out)))
            if self.ep and block.shared_experts is not None:
                _on_owned_tokens(block.shared_experts, self.rank, self.size)
        model.dp_tokens = tokens


class DpTokens:
    """One forward pass's token counts over the group, and the gather and scatter they drive."""

    def __init__(self, comm: Communicator, model: nn.Module) -> None:
        self.comm, self.model = comm, model
        self.blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        self.counts: list[int] = []  # every rank's tokens in this pass, rank order

    def exchange(self, tokens: int) -> None:
        """Collective, once per pass: every rank learns every rank's token count."""
        mine = torch.tensor([float(tokens)])  # counts as float32: every communicator gathers those
        self.counts = [int(c) for c in self.comm.all_gather(mine).tolist()]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [t, hidden] → the group's [sum t, hidden], rank order."""
        most = max(self.counts)
        if most == 0:
            return x
        padded = x.new_zeros(most, x.shape[1])
        padded[:x.shape[0]] = x
        every = self.comm.all_gather(padded.view(1, -1)).view(len(self.counts), most, x.shape[1])
        return torch.cat([every[r, :n] for r, n in enumerate(self.counts)])

    def own_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The group's summed block output [sum t, hidden] → this rank's rows [t, hidden]."""
        first = sum(self.counts[:self.comm.rank])
        return out[first:first + self.counts[self.comm.rank]]

    @torch.inference_mode()
    def idle(self) -> None:
        """This rank's part of a pass it has no tokens for: zero rows through every sparse block."""
        self.exchange(0)
        empty = torch.empty(0, self.model.config.hidden_size, dtype=self.model.norm.weight.dtype,
                            device=self.model.norm.weight.device)
        for block in self.blocks:
            block(empty, self.model.ops)
