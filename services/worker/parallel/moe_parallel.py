"""Expert parallelism put together for one rank: the first placement, which experts the rank
loads, and the dispatch, recorder and rebalancer its model's sparse blocks use.

Pieces: expert_location.py (the placement), expert_parallel.py (the all-to-all dispatch),
expert_rebalance.py (EPLB at run time), services/worker/model/expert_load.py (the loads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from services.worker.config import WorkerConfig
from services.worker.model.config import ModelConfig
from services.worker.model.expert_load import ExpertDump, ExpertLoadRecorder, moe_blocks
from services.worker.parallel.expert_location import ExpertLocation
from services.worker.parallel.expert_parallel import CommTimes, ExpertParallel, LocationHolder
from services.worker.parallel.expert_rebalance import ExpertRebalancer


def moe_layers(mc: ModelConfig) -> list[int]:
    return [i for i in range(mc.num_hidden_layers) if mc.is_moe_layer(i)]


def initial_location(config: WorkerConfig, mc: ModelConfig) -> ExpertLocation | None:
    """The placement a group starts with: from --init-expert-location's loads (EPLB), else spread;
    None without expert parallelism."""
    if config.ep_size == 1:
        return None
    if not mc.num_experts:
        raise ValueError(f"--ep-size {config.ep_size}: the model {mc.architecture} has no experts")
    layers, redundant = moe_layers(mc), config.ep_num_redundant_experts
    if (mc.num_experts + redundant) % config.ep_size:
        raise ValueError(f"--ep-size {config.ep_size} does not divide the {mc.num_experts} experts + "
                         f"{redundant} redundant ones (--ep-num-redundant-experts)")
    if config.init_expert_location is None:
        return ExpertLocation.spread(len(layers), mc.num_experts, config.ep_size, redundant)
    dump = ExpertDump.load(config.init_expert_location)
    loads = torch.tensor(dump.logical_count, dtype=torch.float64)
    if tuple(loads.shape) != (len(layers), mc.num_experts):
        raise ValueError(f"--init-expert-location {config.init_expert_location}: loads of {tuple(loads.shape)} "
                         f"(layers, experts); the model has {len(layers)} MoE layers of {mc.num_experts} experts")
    return ExpertLocation.balanced(loads + 1, config.ep_size, redundant)  # + 1: an unseen expert still counts


def rank_expert_slots(config: WorkerConfig, mc: ModelConfig, rank: int) -> tuple[tuple[int, ...], ...]:
    """Per decoder layer, the logical experts of rank `rank`'s slots (RankPart.expert_slots); ()
    without expert parallelism."""
    location = initial_location(config, mc)
    if location is None:
        return ()
    rows = iter(location.rank_experts(rank).tolist())
    return tuple(tuple(next(rows)) if mc.is_moe_layer(i) else () for i in range(mc.num_hidden_layers))


@dataclass
class ExpertParallelRank:
    """What a rank's runner keeps: the placement it computes with, the rebalancer, the comm times."""
    holder: LocationHolder
    rebalancer: ExpertRebalancer
    times: CommTimes

    @property
    def location(self) -> ExpertLocation:
        return self.holder.location


def install_expert_parallel(model: nn.Module, recorder: ExpertLoadRecorder, config: WorkerConfig,
                            mc: ModelConfig, rank: int, group=None) -> ExpertParallelRank:
    """Route every sparse block of rank `rank`'s model through the all-to-all dispatch; rebalance
    before every --eplb-rebalance-num-iterations-th forward pass with --enable-eplb."""
    holder, times = LocationHolder(initial_location(config, mc)), CommTimes()
    blocks = moe_blocks(model)
    for row, block in enumerate(blocks):
        block.dispatch = ExpertParallel(rank, config.ep_size, holder, row, config.enable_two_batch_overlap,
                                        times, group)
    every = config.eplb_rebalance_num_iterations if config.enable_eplb else None
    # Weight moves cross while a step computes: a process group of their own, so that they never
    # queue in front of that step's dispatches (a collective: every rank creates it here, in order).
    moves = dist.new_group(backend=dist.get_backend(group)) if dist.is_initialized() else group
    rebalancer = ExpertRebalancer(blocks, holder, recorder, rank, config.ep_size, config.ep_num_redundant_experts,
                                  every, config.eplb_rebalance_layers_per_chunk,
                                  config.eplb_rebalance_weights_per_pass, moves)
    model.register_forward_pre_hook(lambda *_: rebalancer.before_forward())
    return ExpertParallelRank(holder, rebalancer, times)
