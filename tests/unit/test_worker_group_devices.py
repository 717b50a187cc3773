"""Where a worker group's ranks run (services/worker/group/leader.py): on CPU, on the caller's
device; on CUDA, local rank r on GPU r, over NCCL, eagerly, and only with a GPU per local rank.
No processes and no GPU: the decisions are checked as the group makes them before any rank starts.
(A CUDA group has not run on a GPU in this repository's tests: no GPU is lent to them.)"""
from __future__ import annotations

import torch

from services.worker.config import WorkerConfig
from services.worker.group.leader import cuda_refusal, group_refusal, rank_config
from services.worker.parallel.communicator import backend_for


def test_cuda_ranks_take_a_gpu_each_and_run_eagerly():
    config = WorkerConfig(device="cuda", tp_size=2, pp_size=2)
    ranks = [rank_config(config, (), local) for local in range(4)]
    assert [r.device for r in ranks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(r.disable_cuda_graph and not r.uses_cuda_graphs for r in ranks)
    assert [backend_for(r.device) for r in ranks] == ["nccl"] * 4


def test_cpu_ranks_keep_the_device_and_gloo():
    rank = rank_config(WorkerConfig(tp_size=3), (1,), 2)
    assert rank.device == "cpu" and backend_for(rank.device) == "gloo" and rank.num_threads == 1


def test_a_cuda_group_needs_a_gpu_per_rank_on_each_node():
    two_nodes = WorkerConfig(device="cuda", tp_size=4, nnodes=2, dist_init_addr="10.0.0.1:29500")
    assert cuda_refusal(two_nodes, 2) is None  # 2 ranks on each node
    assert "2 on each node, and this one has 1" in cuda_refusal(two_nodes, 1)
    assert cuda_refusal(WorkerConfig(tp_size=4), 0) is None  # a CPU group needs none


def test_a_cuda_group_is_refused_by_name_on_a_machine_without_enough_gpus():
    why = group_refusal(WorkerConfig(device="cuda", tp_size=2))
    if torch.cuda.device_count() < 2:
        assert f"this one has {torch.cuda.device_count()}" in why
    else:
        assert why is None
