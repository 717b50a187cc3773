"""Where each expert lives in an expert-parallel group: physical expert slots over the ranks.

A group of `ep` ranks holds P = num_experts + redundant physical experts, P / ep consecutive
slots per rank (rank r: physical r·S .. r·S + S - 1). phy2log[l, p] is the logical expert slot p
computes in MoE layer l; a logical expert with several replicas (EPLB's redundant experts) has
its tokens split evenly between them: the n-th row routed to it in a step goes to replica
n mod replicas, the same choice on every rank (every rank routes the whole batch).

Placements: `spread` (no loads known: expert e in slot e, the redundant slots replicate experts
0, 1, ...), or `balanced` from observed loads (DeepSeek's EPLB, eplb.py), which
--init-expert-location and --enable-eplb use.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from services.worker.parallel import eplb


@dataclass(frozen=True, eq=False)
class ExpertLocation:
    phy2log: torch.Tensor  # [layers, P] int64, one row per MoE layer (the recorder's row order)
    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        layers, physical = self.phy2log.shape
        if physical % self.ep_size:
            raise ValueError(f"{physical} physical experts do not split evenly over --ep-size {self.ep_size}")
        seen = torch.zeros(layers, self.num_experts, dtype=torch.bool).scatter_(1, self.phy2log, True)
        if not bool(seen.all()):
            raise ValueError("an expert placement must hold every logical expert at least once in every layer")

    @classmethod
    def spread(cls, layers: int, num_experts: int, ep_size: int, redundant: int = 0) -> "ExpertLocation":
        physical = torch.arange(num_experts + redundant) % num_experts  # [P]
        return cls(physical.repeat(layers, 1), num_experts, ep_size)

    @classmethod
    def balanced(cls, loads: torch.Tensor, ep_size: int, redundant: int = 0) -> "ExpertLocation":
        """EPLB's placement for loads [layers, num_experts] (token counts)."""
        num_experts = loads.shape[1]
        phy2log, _, _ = eplb.rebalance_experts(loads.float().cpu(), num_experts + redundant, 1, 1, ep_size)
        return cls(phy2log.to(torch.int64), num_experts, ep_size)

    @property
    def slots(self) -> int:
        """Physical experts per rank."""
        return self.phy2log.shape[1] // self.ep_size

    def rank_experts(self, rank: int) -> torch.Tensor:
        """[layers, slots]: the logical expert in each of rank `rank`'s slots."""
        return self.phy2log[:, rank * self.slots:(rank + 1) * self.slots]

    @cached_property
    def logcnt(self) -> torch.Tensor:
        """[layers, num_experts]: each logical expert's replicas."""
        ones = torch.ones_like(self.phy2log)
        return torch.zeros(self.phy2log.shape[0], self.num_experts, dtype=torch.int64).scatter_add_(1, self.phy2log, ones)

    @cached_property
    def replicas(self) -> torch.Tensor:
        """[layers, num_experts, max replicas]: the physical slots of each logical expert (-1 pads)."""
        layers, physical = self.phy2log.shape
        table = torch.full((layers, self.num_experts, int(self.logcnt.max())), -1, dtype=torch.int64)
        for l in range(layers):
            filled = [0] * self.num_experts
            for p, e in enumerate(self.phy2log[l].tolist()):
                table[l, e, filled[e]] = p
                filled[e] += 1
        return table

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """loads [layers, num_experts] → [layers, ep]: the tokens each rank computes under this placement."""
        return eplb.gpu_loads(loads.float().cpu(), self.phy2log, self.logcnt, self.ep_size)

    def same_as(self, other: "ExpertLocation") -> bool:
        return torch.equal(self.phy2log, other.phy2log)

    def changed_rows(self, other: "ExpertLocation") -> list[int]:
        """The MoE layers whose placement differs in `other`."""
        return [r for r in range(self.phy2log.shape[0]) if not torch.equal(self.phy2log[r], other.phy2log[r])]

    def with_rows(self, other: "ExpertLocation", rows: list[int]) -> "ExpertLocation":
        """This placement with `other`'s rows `rows` (a rebalance that has moved those layers)."""
        phy2log = self.phy2log.clone()
        phy2log[rows] = other.phy2log[rows]
        return ExpertLocation(phy2log, self.num_experts, self.ep_size)


def pick_physical(location: ExpertLocation, row: int, experts: torch.Tensor) -> torch.Tensor:
    """experts [T, k] logical ids of MoE layer `row` → [T, k] physical slots: the n-th occurrence of
    a logical expert in the batch (token order) goes to its replica n mod replicas."""
    replicas = location.replicas[row].to(experts.device)  # [E, R]
    flat = experts.flatten()  # [N]
    if replicas.shape[1] == 1:
        return replicas[flat, 0].view_as(experts)
    counts = torch.bincount(flat, minlength=location.num_experts)  # [E]
    first = torch.cumsum(counts, 0) - counts  # [E]: where each expert's rows start once sorted
    order = torch.argsort(flat, stable=True)
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    choice = occurrence % location.logcnt[row].to(experts.device)[flat]
    return replicas[flat, choice].view_as(experts)
