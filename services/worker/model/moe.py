"""A sparse mixture-of-experts MLP block: a router picks top-k experts per token, each a SwiGLU MLP.

Routing (Qwen3-MoE, Mixtral): softmax over the experts' router logits in float32, the top-k
probabilities (renormalized to sum to 1 when norm_topk_prob), cast to the activations' dtype.
The experts are computed grouped: the step's (token, choice) rows are sorted by expert, so each
expert with work runs one gate_up and one down matmul over its rows; index_add_ sums the weighted
rows back per token, in ascending expert order for every token.

Parameters keep transformers' in-memory names, so a checkpoint saved with fused experts loads
as it is: gate.weight [E, hidden], experts.gate_up_proj [E, 2I, hidden] ([gate; up] rows),
experts.down_proj [E, hidden, I]. Per-expert checkpoints (experts.{e}.gate_proj.weight, ...,
what the Hub holds) are stacked by fuse_hf.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model.layer_ops import LayerOps
from services.worker.model.linear import Linear


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden]; experts [T, k] int64, weights [T, k] in x's dtype → [T, hidden]."""
        k = experts.shape[1]
        flat = experts.flatten()  # [T k], row r = (token r // k, choice r % k)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, token order within
        tokens = order // k  # [T k]
        rows = x.index_select(0, tokens)  # [T k, hidden]
        row_w = weights.flatten().index_select(0, order).unsqueeze(1)  # [T k, 1]
        out = torch.empty_like(rows)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                h = ops.silu_mul(F.linear(rows[sl], self.gate_up_proj[e]))  # [n, I]
                out[sl] = F.linear(h, self.down_proj[e]) * row_w[sl]  # [n, hidden]
                start += n
        return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = Linear(hidden, num_experts, bias=False)  # the router
        self.experts = GroupedExperts(num_experts, hidden, intermediate)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # x [T, hidden]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, experts, weights.to(x.dtype), ops)

    def fuse_hf(self, t: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """Pop per-expert checkpoint tensors under prefix ("layers.3.mlp.") → the stacked
        experts.gate_up_proj / down_proj; a checkpoint with them stacked already: nothing to do."""
        name = f"{prefix}experts.{{}}.{{}}_proj.weight"
        if name.format(0, "gate") not in t:
            return {}
        per_expert = range(self.num_experts)
        gate_up = [torch.cat([t.pop(name.format(e, "gate")), t.pop(name.format(e, "up"))], 0) for e in per_expert]
        down = [t.pop(name.format(e, "down")) for e in per_expert]
        return {f"{prefix}experts.gate_up_proj": torch.stack(gate_up), f"{prefix}experts.down_proj": torch.stack(down)}
