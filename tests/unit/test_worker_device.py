"""The device-agnostic worker's host-side pieces, on the CPU: the --device / --attention-backend
checks and what auto resolves to, KV sizing from the pool's own device, the one-copy move of a
step's index tensors, and the launch / device-wait split that /metrics reports. What needs CUDA
(pinned copies, graphs) is in the gpu-marked test at the end."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from services.worker import kv_pool
from services.worker.attention.batch_layout import BatchLayout
from services.worker.config import WorkerConfig
from services.worker.device_stats import DeviceStats
from services.worker.host_to_device import to_device


@pytest.mark.parametrize("device, backend, message", [
    ("cuda", "cpu", "on --device cuda use auto, triton or flashinfer"),
    ("cpu", "flashinfer", "runs on CUDA only"),
    ("tpu", "auto", "--device must be cpu or cuda"),
    ("not-a-device", "auto", "--device must be cpu or cuda"),
])
def test_a_device_its_backend_cannot_serve_is_refused(device, backend, message) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(device=device, attention_backend=backend)


def test_auto_is_the_cpu_backend_on_cpu_and_triton_or_flashinfer_on_cuda(monkeypatch) -> None:
    assert WorkerConfig().resolved_attention_backend == "cpu"
    assert WorkerConfig(attention_backend="torch").resolved_attention_backend == "torch"
    real = importlib.util.find_spec
    for installed, expected in ((True, "flashinfer"), (False, "triton")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, ok=installed: (object() if ok else None) if name == "flashinfer"
                            else real(name, *a))
        assert WorkerConfig(device="cuda", disable_cuda_graph=True).resolved_attention_backend == expected
        assert WorkerConfig(device="cuda").resolved_attention_backend == "triton"  # graphs need a capturable one
    assert WorkerConfig(device="cuda").uses_cuda_graphs
    assert not WorkerConfig(device="cuda", disable_cuda_graph=True).uses_cuda_graphs
    assert not WorkerConfig().uses_cuda_graphs
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        WorkerConfig(cuda_graph_max_bs=0)


def test_a_cpu_pool_is_sized_from_host_memory_even_on_a_gpu_machine(monkeypatch) -> None:
    """The bug this fixes: CUDA's free memory sized a --device cpu pool whenever torch saw a GPU."""
    def no_gpu_query(*args):
        raise AssertionError("a CPU pool asked the GPU for its free memory")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu_query)
    with open("/proc/meminfo") as f:
        meminfo = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(kv_pool.available_memory_bytes("cpu") - meminfo) < 256 << 20  # it moves a little meanwhile


def test_cuda_free_memory_sizes_a_cuda_pool(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (8 << 30, 16 << 30))
    assert kv_pool.available_memory_bytes("cuda:0") == 8 << 30
    assert asked == [torch.device("cuda:0")]
    from services.worker.model.config import ModelConfig
    mc = ModelConfig(name="toy", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    spec = kv_pool.KVPoolSpec.from_budget(mc, 16, torch.bfloat16, None, 0.5, "cuda:0")
    assert spec.num_pages == (4 << 30) // (spec.bytes_per_token * 16)


@pytest.mark.parametrize("available,budget", [(24 << 30, 3 << 30), (4 << 30, 2 << 30)])
def test_the_default_pool_is_3_gib_or_half_the_available_memory(monkeypatch, available, budget) -> None:
    """No --kv-cache-bytes and no --kv-mem-fraction: 3 GiB, less on a machine with less than 6 GiB free."""
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda device="cpu": available)
    from services.worker.model.config import ModelConfig
    mc = ModelConfig(name="toy", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    spec = kv_pool.KVPoolSpec.from_budget(mc, 16, torch.bfloat16, None, None)
    assert spec.num_pages == budget // (spec.bytes_per_token * 16)


def test_a_host_pool_takes_memory_only_for_the_pages_written() -> None:
    """The pool is an anonymous mapping (services/common/host_memory.py): zeros, resident once written."""
    import psutil
    process = psutil.Process()
    from services.worker.model.config import ModelConfig
    mc = ModelConfig(name="toy", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    before = process.memory_info().rss
    pool = kv_pool.KVPool(kv_pool.KVPoolSpec.from_budget(mc, 16, torch.float32, 1 << 30, None))
    assert process.memory_info().rss - before < 64 << 20  # 1 GiB reserved, next to nothing resident
    assert not pool.k[0, :64].any() and not pool.v[-1, -64:].any()  # zeros, as torch.zeros gave
    pool.write(3, torch.arange(16), torch.ones(16, 2, 64), torch.ones(16, 2, 64))
    assert pool.k[3, :16].eq(1).all() and not pool.k[3, 16:32].any()
    pool.k[1].fill_(2.0)  # one layer's K written: a quarter of the K half, 128 MiB resident
    assert process.memory_info().rss - before > 100 << 20
    del pool  # the mapping goes with the last tensor viewing it
    assert process.memory_info().rss - before < 64 << 20


def test_the_layout_stays_put_on_cpu_and_to_device_keeps_values_and_order() -> None:
    layout = BatchLayout.build([3, 1], [0, 5], torch.tensor([[0, 1], [2, 3]]), 4)
    assert layout.to(torch.device("cpu")) is layout
    tensors = [torch.arange(6).view(2, 3), torch.tensor([7]), torch.empty(0, dtype=torch.int64)]
    assert to_device(tensors, torch.device("cpu")) is tensors
    with pytest.raises(ValueError, match="int64 host tensors"):
        to_device([torch.zeros(2, dtype=torch.int32)], torch.device("meta"))


def test_device_stats_count_launches_not_declined_steps() -> None:
    stats = DeviceStats()
    assert stats.timed(lambda: None) is None  # a one-call path that declined
    assert stats.eager_steps == 0
    out = stats.timed(lambda: torch.ones(3).sum())
    assert float(out) == 3.0 and stats.eager_steps == 1 and stats.graph_replays == 0
    stats.timed(lambda: 1, replayed=True)
    assert stats.graph_replays == 1
    assert stats.launch_seconds > 0 and stats.device_seconds == 0  # no device clock on the CPU
    metrics = stats.metrics()
    assert metrics["worker_eager_steps"] == ("counter", metrics["worker_eager_steps"][1], 1)


def test_a_cuda_worker_without_cuda_says_so_before_loading_anything() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from services.worker.model_runner import ModelRunner
    with pytest.raises(ValueError, match="torch sees no CUDA device.*use --device cpu"):
        ModelRunner(WorkerConfig(device="cuda"), checkpoint=None)


@pytest.mark.gpu
def test_to_device_moves_pinned_in_one_copy_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tensors = [torch.arange(6).view(2, 3), torch.tensor([7, 8])]
    moved = to_device(tensors, torch.device("cuda"))
    assert all(m.is_cuda for m in moved)
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()  # one buffer
    assert [m.cpu().tolist() for m in moved] == [t.tolist() for t in tensors]
