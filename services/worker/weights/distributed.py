"""The worker's side of a torch.distributed weight update: join a trainer's group, receive tensors.

The group is services/common/weight_sync.open_group's: its own store and backend object
(gloo on CPU, NCCL on CUDA), apart from torch.distributed's default group, which the worker
never creates. The worker is rank `rank_offset` (the trainer is rank 0; a router gives replica
i the rank rank_offset + i). Receiving allocates one buffer per announced tensor (name, dtype,
shape) and takes part in rank 0's broadcast of each, in order; every tensor arrives before
staging checks any of them, so a trainer that sent what it announced always completes its
broadcast, even when the worker then refuses the update. A failure mid-way (the trainer died:
its sockets close at once; it hangs: the group's timeout) breaks the group: it is closed and
forgotten, and the error says to join again.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.weight_sync import DEFAULT_TIMEOUT_S, Group, open_group, parse_dtype
from services.worker.weights.errors import WeightUpdateError


class UpdateGroups:
    """The groups a worker has joined, by name."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None) -> Group:
        """Join as rank rank_offset; blocks until every rank joined. Re-joining a name closes the old
        group first. device: the worker's (nccl receives there). Raises WeightUpdateError when the
        arguments are wrong or the join fails/times out."""
        self.close(group_name)
        if rank_offset < 1:
            raise WeightUpdateError(f"rank_offset {rank_offset}: rank 0 is the trainer's, a worker's rank is >= 1")
        try:
            group = open_group(master_address, master_port, rank_offset, world_size, group_name, backend or "gloo",
                               timeout_s or DEFAULT_TIMEOUT_S, device if backend == "nccl" else None)
        except (ValueError, RuntimeError) as e:  # torch's DistStoreError / timeouts are RuntimeErrors
            raise WeightUpdateError(f"joining weight-update group {group_name!r} at {master_address}:{master_port} "
                                    f"as rank {rank_offset} of {world_size} failed: {e}") from e
        self.groups[group_name] = group
        return group

    def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
                shapes: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Take part in rank 0's broadcast of each announced tensor, in order → name → tensor
        (on the group's device). Raises WeightUpdateError; a broken group is closed."""
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no weight-update group {group_name!r}: call init_weights_update_group first "
                                    f"(joined: {sorted(self.groups)})")
        buffers = _buffers(names, dtypes, shapes, group.device)
        try:
            for t in buffers.values():
                group.broadcast(t)  # [*shape]: overwritten with rank 0's
        except RuntimeError as e:
            self.close(group_name)
            raise WeightUpdateError(f"receiving from weight-update group {group_name!r} failed (the trainer died "
                                    f"or stopped sending within {group.timeout_s:g} s); the group is closed, "
                                    f"join it again: {e}") from e
        return buffers

    def close(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is not None:
            group.close()

    def close_all(self) -> None:
        for name in list(self.groups):
            self.close(name)


def _buffers(names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]],
             device: torch.device) -> dict[str, torch.Tensor]:
    """One empty tensor per announced (name, dtype, shape), in order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: "
                                "one each per tensor")
    if len(set(names)) != len(names):
        raise WeightUpdateError("a tensor name is announced twice")
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        try:
            dt = parse_dtype(dtype)
        except ValueError as e:
            raise WeightUpdateError(f"{name}: {e}") from e
        if any(int(d) < 0 for d in shape):
            raise WeightUpdateError(f"{name}: negative dimension in shape {list(shape)}")
        out[name] = torch.empty([int(d) for d in shape], dtype=dt, device=device)
    return out
