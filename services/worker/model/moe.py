"""A sparse mixture-of-experts MLP block: a router picks top-k experts per token, each a SwiGLU MLP.

Routing (Qwen3-MoE, Mixtral): softmax over the experts' router logits in float32, the top-k
probabilities (renormalized to sum to 1 when norm_topk_prob), cast to the activations' dtype.
The experts are computed grouped: the step's (token, choice) rows are sorted by expert, so each
expert with work runs one gate_up and one down matmul over its rows (GroupedExperts.run_sorted;
on CUDA one Triton grouped GEMM launch for all of them); index_add_ sums the weighted rows back
per token, in ascending expert order for every token.

Where the rows are computed is the block's `dispatch`: here, in this process (LocalExperts), or
on the ranks that own each expert (services/worker/parallel/expert_parallel.py, --ep-size), which
the runner installs. Its `recorder` (expert_load.py) counts the tokens each expert is routed.

Parameters keep transformers' in-memory names, so a checkpoint saved with fused experts loads
as it is: gate.weight [E, hidden], experts.gate_up_proj [slots, 2I, hidden] ([gate; up] rows),
experts.down_proj [slots, hidden, I]. slots = E, except on an expert-parallel rank: the physical
experts it holds. Per-expert checkpoints (experts.{e}.gate_proj.weight, ..., what the Hub holds)
are stacked by fuse_hf.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.layer_ops import LayerOps
from services.worker.model.linear import Linear


def routing_fields(raw: dict, family: str, experts_keys: tuple[str, str], default_experts: int,
                   default_top_k: int) -> tuple[int, int]:
    """config.json's (experts, experts per token) for a sparse MoE family, checked: SiLU experts
    only, top-k within 1 .. experts. experts_keys: the key the family writes, then its alias."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family} hidden_act {act!r} is not supported (only 'silu')")
    experts = int(raw.get(experts_keys[0], raw.get(experts_keys[1], default_experts)))
    top_k = int(raw.get("num_experts_per_tok", default_top_k))
    if not 1 <= top_k <= experts:
        raise ValueError(f"{family} num_experts_per_tok={top_k} must be within 1 .. {experts_keys[0]}={experts}")
    return experts, top_k


class GroupedExperts(nn.Module):
    def __init__(self, slots: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(slots, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(slots, hidden, intermediate))

    @property
    def slots(self) -> int:
        return self.gate_up_proj.shape[0]

    def run_sorted(self, rows: torch.Tensor, counts: list[int], ops: LayerOps) -> torch.Tensor:
        """rows [N, hidden] sorted by slot, counts[s] of them for slot s → [N, hidden], unweighted."""
        if rows.is_cuda:
            return self._run_triton(rows, counts, ops)
        out = torch.empty_like(rows)
        start = 0
        for s, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                h = ops.silu_mul(F.linear(rows[sl], self.gate_up_proj[s]))  # [n, I]
                out[sl] = F.linear(h, self.down_proj[s])  # [n, hidden]
                start += n
        return out

    def _run_triton(self, rows: torch.Tensor, counts: list[int], ops: LayerOps) -> torch.Tensor:
        from kernels.triton.grouped_gemm import grouped_gemm
        offsets = torch.tensor([0, *counts], device=rows.device).cumsum(0)  # [slots + 1]
        h = ops.silu_mul(grouped_gemm(rows, offsets, self.gate_up_proj))  # [N, I]
        return grouped_gemm(h, offsets, self.down_proj)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden]; experts [T, k] int64 slots, weights [T, k] in x's dtype → [T, hidden]."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T k], row r = (token r // k, choice r % k)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, token order within
        tokens = order // k  # [T k]
        counts = torch.bincount(flat, minlength=self.slots).tolist()
        out = self.run_sorted(x.index_select(0, tokens), counts, ops)  # [T k, hidden]
        out *= weights.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class ExpertDispatch(Protocol):
    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, grouped: GroupedExperts,
                 ops: LayerOps) -> torch.Tensor:
        """x [T, hidden]; the router's logical experts [T, k] and weights [T, k] → the block's output [T, hidden]."""


def local_experts(x, experts, weights, grouped: GroupedExperts, ops: LayerOps) -> torch.Tensor:
    """Every expert in this process: slot e is logical expert e."""
    return grouped(x, experts, weights, ops)


class SparseMoeBlock(nn.Module):
    """router: a module with weight [E, hidden] and route(x) → (experts, weights) (DeepSeek-V3's
    GroupLimitedRouter); None: softmax top-k over a Linear's logits. shared: an MLP every token
    runs beside its experts (DeepSeek's shared experts), added to their output; None: none."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 slots: int | None = None, layer: int = 0, router: nn.Module | None = None,
                 shared: nn.Module | None = None):
        super().__init__()
        self.gate = router if router is not None else Linear(hidden, num_experts, bias=False)  # the router
        self.experts = GroupedExperts(slots or num_experts, hidden, intermediate)
        self.shared_experts = shared
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.layer = layer  # the decoder layer it sits in (the recorder's row)
        self.dispatch: ExpertDispatch = local_experts
        self.recorder = None  # an ExpertLoadRecorder (expert_load.py), or None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (experts [T, k] int64, weights [T, k] float32)."""
        if not isinstance(self.gate, Linear):
            return self.gate.route(x)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # x [T, hidden]
        experts, weights = self.route(x)
        if self.recorder is not None:
            self.recorder.record(self.layer, experts)
        out = self.dispatch(x, experts, weights.to(x.dtype), self.experts, ops)
        return out if self.shared_experts is None else out + self.shared_experts(x, ops)

    @classmethod
    def for_layer(cls, config, layer: int) -> "SparseMoeBlock":
        """Decoder layer `layer`'s block of a ModelConfig with experts (an expert-parallel rank's
        config holds its expert_slots)."""
        return cls(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                   config.norm_topk_prob, config.expert_slots or None, layer)

    def fuse_hf(self, t: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """Pop per-expert checkpoint tensors under prefix ("layers.3.mlp.") → the stacked
        experts.gate_up_proj / down_proj; a checkpoint with them stacked already: nothing to do."""
        fused = {} if self.shared_experts is None else self.shared_experts.fuse_hf(t, f"{prefix}shared_experts.")
        name = f"{prefix}experts.{{}}.{{}}_proj.weight"
        if name.format(0, "gate") not in t:
            return fused
        per_slot = range(self.experts.slots)
        gate_up = [torch.cat([t.pop(name.format(e, "gate")), t.pop(name.format(e, "up"))], 0) for e in per_slot]
        down = [t.pop(name.format(e, "down")) for e in per_slot]
        return {**fused, f"{prefix}experts.gate_up_proj": torch.stack(gate_up),
                f"{prefix}experts.down_proj": torch.stack(down)}
