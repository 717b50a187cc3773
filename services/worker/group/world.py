"""The steps every rank of a worker group takes to join it, in the same order on every rank.

1. join the default process group (`--dist-init-addr`, rank, world size, `--dist-timeout-s`);
2. compare configurations: every rank contributes the digest of the flags that must agree
   (the model files' content identity, the group's sizes, dtypes, pages, limits, adapters); a rank
   started with others fails the group on every rank, with a message naming the flags and ranks;
3. with several nodes, make the nodes' control group (each node's first rank), over which the
   leader sends each command to the other nodes, with no timeout while the group is idle;
4. make the rank's TP communicator and pipeline link (placement.py); across nodes the
   all-reduce is gloo's (shared memory is one host's).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from services.worker.config import WorkerConfig
from services.worker.host_pool import model_identity

# The flags every rank must share: a rank that differs would compute another model or another
# batch. (Threads, cores, the listen address and logging may differ per rank.)
MUST_AGREE = ("tp_size", "pp_size", "ep_size", "enable_dp_attention", "dp_size", "ep_num_redundant_experts", "enable_eplb",
              "eplb_rebalance_num_iterations", "eplb_rebalance_layers_per_chunk", "eplb_rebalance_weights_per_pass",
              "init_expert_location", "enable_two_batch_overlap", "pp_micro_batches", "pp_micro_batch_tokens", "nnodes", "dtype", "kv_cache_dtype", "quantization", "page_size", "max_requests",
              "context_length", "kv_cache_bytes", "max_loras", "max_lora_rank", "lora_paths", "all_reduce",
              "attention_backend", "fused_ops", "prepack_weights")
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # the nodes wait for the leader's next command


@dataclass(frozen=True)
class Joined:
    comm: object  # the rank's TP Communicator
    pipe: object  # its PipeLink, or None
    nodes: object  # the nodes' control group (several nodes), or None


def agreed_settings(config: WorkerConfig, source: str) -> dict[str, str]:
    values = {f.name: repr(getattr(config, f.name)) for f in fields(config) if f.name in MUST_AGREE}
    values["resolved dtype"] = config.resolved_dtype
    # The KV namespace's content identity (host_pool.py): the same bytes give the same identity on every node.
    path = os.path.realpath(source)
    values["model"] = model_identity(os.path.basename(path), path)
    return values


def check_same_config(config: WorkerConfig, source: str, group=None) -> None:
    """Collective: ValueError on every rank when any rank's agreed settings differ from rank 0's.
    group: a gloo group over every rank (the objects travel on the CPU), None: the default one."""
    mine = agreed_settings(config, source)
    everyone: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine, group=group)
    leader = everyone[0]
    differ = {rank: sorted(k for k in leader if theirs.get(k) != leader[k]) for rank, theirs in enumerate(everyone)}
    differ = {rank: keys for rank, keys in differ.items() if keys}
    if differ:
        lines = [f"rank {rank}: " + ", ".join(f"{k} {everyone[rank].get(k)} (rank 0: {leader[k]})" for k in keys)
                 for rank, keys in sorted(differ.items())]
        raise ValueError("the worker group's ranks were started with different settings; " + "; ".join(lines))


def join_world(rank: int, config: WorkerConfig, init_method: str, source: str, group_id: str,
               hidden: int) -> Joined:
    from services.worker.parallel.communicator import backend_for, init_group
    from services.worker.parallel.placement import Placement
    backend = backend_for(config.device)  # NCCL for a CUDA group (config.device: this rank's GPU)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(config.device))
    init_group(init_method, rank, config.world_size, config.dist_timeout_s, backend)
    torch.set_num_threads(config.num_threads or 1)  # before the all-reduce probes: one team per rank
    # Settings and commands are pickled objects: they travel over gloo groups, on the CPU.
    check_same_config(config, source, dist.new_group(backend="gloo") if backend == "nccl" else None)
    nodes = None
    if config.nnodes > 1:  # every rank creates it (a collective), only the nodes' first ranks are in it
        per = config.world_size // config.nnodes
        nodes = dist.new_group([k * per for k in range(config.nnodes)], timeout=CONTROL_TIMEOUT, backend="gloo")
    all_reduce = "gloo" if config.nnodes > 1 else config.all_reduce
    comm, pipe = Placement(rank, config.tp_size, config.pp_size).join(
        group_id, hidden, config.torch_dtype, config.dist_timeout_s, all_reduce, config.device)
    return Joined(comm, pipe, nodes)
