"""DeepSeek's MoE routers: group-limited top-k over the experts' scores.

V3 ("noaux_tc"): scores = sigmoid(W x) in float32 [E]. The choice adds e_score_correction_bias
(set in training so that every expert gets its share, with no auxiliary loss). The E experts are
split into n_group groups; each group is scored by the sum of its two best biased scores, only the
topk_group best groups stay eligible, and the top_k biased scores among them are the token's
experts. Their weights are the unbiased scores, normalised to sum to 1 when norm_topk_prob.

V2 ("greedy", "group_limited_greedy"): scores = softmax(W x) in float32. greedy: the top_k
scores; group_limited_greedy: each group is scored by its best score, the topk_group best groups
stay eligible. The weights are the chosen scores, never renormalised.

Either way the weights are then multiplied by routed_scaling_factor. Parameter names follow
transformers (mlp.gate.weight; V3's mlp.gate.e_score_correction_bias).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


class GroupLimitedRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, method: str = "noaux_tc"):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"topk_method {method!r} is not supported (supported: {', '.join(METHODS)})")
        if experts % n_group:
            raise ValueError(f"n_group={n_group} does not divide the {experts} routed experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be within 1 .. n_group={n_group}")
        if top_k > topk_group * (experts // n_group):
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group} eligible groups' "
                             f"{topk_group * (experts // n_group)} experts")
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(experts), requires_grad=False)
                                        if method == "noaux_tc" else None)
        self.method, self.top_k, self.n_group, self.topk_group = method, top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (experts [T, k] int64, weights [T, k] float32)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if self.method != "noaux_tc":
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                scores = scores.masked_fill(~self._eligible(scores, lambda g: g.max(dim=-1).values), 0.0)
            weights, experts = scores.topk(self.top_k, dim=-1)
            return experts, weights * self.routed_scaling_factor
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:
            top2 = lambda g: g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)  # noqa: E731
            choice = choice.masked_fill(~self._eligible(choice, top2), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor

    def _eligible(self, scores: torch.Tensor, group_score) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups (group_score: [T, G, E/G] → [T, G])."""
        T, E = scores.shape
        per_group = group_score(scores.view(T, self.n_group, E // self.n_group))  # [T, n_group]
        kept = per_group.topk(self.topk_group, dim=-1).indices
        eligible = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, kept, True)
        return eligible.repeat_interleave(E // self.n_group, dim=1)
