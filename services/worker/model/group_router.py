"""DeepSeek-V3's MoE router ("noaux_tc"): sigmoid scores, a load-balancing bias that steers the
choice but not the weights, and group-limited top-k.

Per token: scores = sigmoid(W x) in float32 [E]. The choice adds e_score_correction_bias (set in
training so that every expert gets its share, with no auxiliary loss). The E experts are split
into n_group groups; each group is scored by the sum of its two best biased scores, only the
topk_group best groups stay eligible, and the top_k biased scores among them are the token's
experts. Their weights are the unbiased scores, normalised to sum to 1 when norm_topk_prob, times
routed_scaling_factor. Parameter names follow transformers (mlp.gate.weight,
mlp.gate.e_score_correction_bias).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupLimitedRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if experts % n_group:
            raise ValueError(f"n_group={n_group} does not divide the {experts} routed experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be within 1 .. n_group={n_group}")
        if top_k > topk_group * (experts // n_group):
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group} eligible groups' "
                             f"{topk_group * (experts // n_group)} experts")
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (experts [T, k] int64, weights [T, k] float32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, n_group]
            kept = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~eligible.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor
