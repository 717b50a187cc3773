"""What a sharded model needs from its group: sum a tensor across the ranks, gather one.

A `Communicator` is the whole interface the parallel layers see (tensor_parallel.py). `Solo` is
the group of one (nothing to do); `DistCommunicator` runs torch.distributed's collectives
(gloo on CPU, across hosts too; NCCL on CUDA). A shared-memory all-reduce for ranks on one host
(shm_allreduce.py) plugs in behind the same two methods.

Every collective is bounded: the process group's timeout (`--dist-timeout-s`) turns a dead or
hung rank into an error at the next collective instead of a hang.
"""
from __future__ import annotations

import datetime
import logging
from typing import Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks (every rank passes the same shape and dtype); may reuse x."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank → [..., world_size * n], rank 0's columns first."""


class Solo:
    """The group of one: the identity."""

    rank, world_size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DistCommunicator:
    """torch.distributed over a process group: the default one (init_group), or a stage's TP
    group under pipeline parallelism; gloo's on CPU tensors, NCCL's on a CUDA group's."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def backend_for(device: str) -> str:
    """The process group's backend for ranks on `device`: NCCL for CUDA, gloo for CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(init_method: str, rank: int, world_size: int, timeout_s: float, backend: str = "gloo") -> None:
    """Join the group's default process group (blocks until every rank joined, at most timeout_s)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("joined the worker group", extra={"rank": rank, "world_size": world_size, "backend": backend})


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
