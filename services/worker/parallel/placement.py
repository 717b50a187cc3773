"""Where a global rank sits in a TP × PP worker group, and the links it computes through.

Global rank g = stage · tp + tp_rank: the TP ranks of a stage are neighbours (one host's cores
when the group spans hosts stage by stage). Each stage's TP ranks form a process group of their
own; TP rank t of stage s sends its hidden states to TP rank t of stage s + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.worker.parallel.communicator import Communicator, DistCommunicator, Solo
from services.worker.parallel.pipeline import PipeLink
from services.worker.parallel.shm_allreduce import ShmCommunicator, choose_communicator


@dataclass(frozen=True)
class Placement:
    rank: int  # global
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    def join(self, group_id: str, hidden: int, dtype: torch.dtype, timeout_s: float,
             all_reduce: str = "auto", device: str = "cpu") -> tuple[Communicator, PipeLink | None]:
        """This rank's TP communicator and pipeline link. Collective: every rank of the group
        calls it once, after init_group, and creates every stage's TP group in the same order.
        A one-stage group all-reduces through shared memory or gloo, whichever is faster here
        on [1, hidden] and [64, hidden] (shm_allreduce.choose_communicator; group_id names its
        segment); all_reduce "shm" or "gloo" takes that one without measuring. On CUDA (device)
        every collective is the NCCL process group's."""
        if self.pp == 1:
            if self.tp == 1:
                return Solo(), None
            if all_reduce == "gloo" or torch.device(device).type == "cuda":
                return DistCommunicator(), None
            if all_reduce == "shm":
                return ShmCommunicator(group_id, timeout_s=timeout_s, fallback=DistCommunicator()), None
            return choose_communicator(group_id, ((1, hidden), (64, hidden)), dtype, timeout_s=timeout_s), None
        groups = [dist.new_group(list(range(s * self.tp, (s + 1) * self.tp))) for s in range(self.pp)]
        comm = DistCommunicator(groups[self.pp_rank]) if self.tp > 1 else Solo()
        s, last = self.pp_rank, self.pp - 1
        link = PipeLink(rank=s, size=self.pp, prev=self.rank - self.tp if s > 0 else None,
                        next=self.rank + self.tp if s < last else None, logits_from=last * self.tp, device=device)
        return comm, link
