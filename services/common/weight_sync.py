"""The trainer's side of a weight update (RL loops), and the wire conventions both sides share.

A trainer process imports this module (it needs torch and safetensors, nothing of the worker's)
to hand a serving worker new weights in one of two ways:

- same host: `write_shared_tensors` writes the named tensors as one safetensors file into shared
  memory (/dev/shm), a plain header plus raw bytes (no pickle: the worker never runs code from
  it), and returns its path; the trainer passes that path to the worker's
  UpdateWeightsFromTensor (the worker maps the file, services/worker/weights/shared_tensors.py)
  and removes it afterwards (`remove_shared_tensors`).
- any host: `WeightBroadcaster` joins a torch.distributed group as rank 0 and broadcasts each
  tensor, in order, to every worker rank (InitWeightsUpdateGroup, then
  UpdateWeightsFromDistributed with `tensor_metas(...)` of the same tensors).

The group is a backend object of its own (`open_group`: a TCPStore under a prefix, then
ProcessGroupGloo or ProcessGroupNCCL), never torch.distributed's default group, so a trainer
that already runs one (FSDP, DDP) keeps it untouched. Every collective has the group's timeout:
a peer that dies mid-broadcast fails the other side's call (at once when its sockets close,
after timeout_s when it hangs), never blocks it forever.

Joining blocks until every rank has joined: the trainer calls `WeightBroadcaster(...)` while
the workers' InitWeightsUpdateGroup calls run (e.g. the RPC in a thread), and likewise runs
`broadcast` while UpdateWeightsFromDistributed is in flight.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 60.0


# --- same host: shared memory ---------------------------------------------------------------
def write_shared_tensors(tensors: Mapping[str, torch.Tensor], directory: str | None = None,
                         name: str | None = None) -> str:
    """Write named tensors as one safetensors file into shared memory (directory: /dev/shm where
    it exists, else the temp dir) → the file's path, for UpdateWeightsFromTensor. Tensors go to
    CPU and contiguous first; their dtypes are kept (the worker casts to its own)."""
    from safetensors.torch import save_file
    directory = directory or (SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir())
    path = os.path.join(directory, name or f"radixmesh-weights-{uuid.uuid4().hex}.safetensors")
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    tmp = f"{path}.partial"
    save_file(cpu, tmp)
    os.replace(tmp, path)  # the worker never sees a half-written file
    return path


def remove_shared_tensors(path: str) -> None:
    """Delete a file write_shared_tensors made (once the worker's update returned)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --- any host: a torch.distributed group ------------------------------------------------------
@dataclass(frozen=True)
class TensorMeta:
    """What the worker needs to receive one broadcast tensor (UpdateWeightsFromDistributed)."""

    name: str  # HF name, e.g. model.layers.0.self_attn.q_proj.weight
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]


def tensor_metas(tensors: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The metadata of named tensors, in the order `WeightBroadcaster.broadcast` sends them."""
    return [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """"bfloat16", "torch.bfloat16" or a torch.dtype → the torch.dtype; ValueError otherwise."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class Group:
    """One side's handle on a weight-update group: its own backend object and store."""

    name: str
    backend: str
    rank: int
    world_size: int
    timeout_s: float
    store: dist.Store
    pg: object  # a ProcessGroupGloo or ProcessGroupNCCL (torch.distributed's Backend)
    device: torch.device  # where its tensors must be: CPU for gloo, this rank's GPU for nccl

    def broadcast(self, tensor: torch.Tensor) -> None:
        """tensor: rank 0's is sent, every other rank's is overwritten. Raises RuntimeError when a
        peer fails or does not answer within the timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # a peer already gone
                pass
        self.pg = None


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
               device: torch.device | str | None = None) -> Group:
    """Join the group `group_name` as `rank` (rank 0, the trainer, hosts its TCPStore at
    master_address:master_port); blocks until all world_size ranks joined or raises
    RuntimeError/ValueError after timeout_s. Never touches torch.distributed's default group.
    device: nccl only, this rank's GPU (default: the current one); gloo runs on CPU tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    where = _group_device(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"radixmesh-weights/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return Group(group_name, backend, rank, world_size, timeout_s, store, pg, where)


def _group_device(backend: str, device: torch.device | str | None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend nccl needs CUDA and a torch built with NCCL")
    where = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if where.type != "cuda":
        raise ValueError(f"backend nccl needs a CUDA device, got {where}")
    return where


class WeightBroadcaster:
    """The trainer as rank 0 of a weight-update group: join, then broadcast named tensors.

        sync = WeightBroadcaster("10.0.0.5", 29600, world_size=2, group_name="rl")  # with the
        #   workers' InitWeightsUpdateGroup(master_address="10.0.0.5", master_port=29600,
        #   rank_offset=1, world_size=2, group_name="rl") in flight
        metas = tensor_metas(state)  # → UpdateWeightsFromDistributed(group_name="rl", tensors=metas)
        sync.broadcast(state)        # while that call is in flight
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None):
        self.group = open_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s, device)

    def broadcast(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
        """Send each tensor, in order, to every worker rank → their metadata (what the workers'
        update call must list, in the same order). Raises RuntimeError when a worker fails."""
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        metas = []
        with torch.no_grad():
            for name, t in items:
                t = t.detach().to(self.group.device).contiguous()
                self.group.broadcast(t)
                metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)))
        return metas

    def close(self) -> None:
        self.group.close()
