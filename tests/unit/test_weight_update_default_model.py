"""Weight updates on the default model (SmolLM2-135M, Q4_1 GGUF; slow: it takes the `checkpoint`
fixture): each path's seconds, printed (`pytest -s`) for the benchmark, and what it serves after:
the same file from disk serves as before; its tensors in bfloat16 from shared memory, then from a
trainer process over gloo, serve as a fresh runner started on them."""
from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file

from services.common.weight_sync import remove_shared_tensors, write_shared_tensors
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import Checkpoint
from services.worker.model_runner import ModelRunner
from tests.unit.test_weight_update_distributed import receive
from tests.unit.tiny_models import logits_by_position

PAGE = 16
SEQS = {"a": [(37 * i + 11) % 49152 for i in range(24)], "b": [(101 * i + 5) % 49152 for i in range(13)]}
CHUNKS = {"a": [20], "b": [10]}  # then decode steps of 2 rows, 1 row: one-call steps on the file's blocks


def config() -> WorkerConfig:
    return WorkerConfig(page_size=PAGE, kv_cache_bytes=64 << 20, max_requests=4)


def trace(r: ModelRunner) -> list[torch.Tensor]:
    return [row for rid in SEQS for _, row in logits_by_position(r, SEQS, CHUNKS, PAGE)[rid]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def show(report) -> None:
    fields = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in dataclasses.asdict(report).items())
    print(f"\nweight update {report.path}: total {report.total_seconds:.3f} s ({fields})")


def test_each_path_on_the_default_model(checkpoint, model_path, tmp_path):
    r = ModelRunner(config(), checkpoint)
    before = trace(r)

    report = r.update_weights_from_disk(model_path)  # the same file: the same weights and blocks
    show(report)
    assert report.version == 1 and r.decode_stack == (r.one_call_rows > 0)
    assert same(trace(r), before)

    sent = {n: t.to(torch.bfloat16) for n, t in checkpoint.tensors.items()}
    path = write_shared_tensors(sent)
    try:
        report = r.update_weights_from_tensor(shm_path=path)
        show(report)
        assert report.version == 2 and report.bytes == sum(t.numel() * 2 for t in sent.values())
        fresh = ModelRunner(config(), Checkpoint(checkpoint.config, {n: t.float() for n, t in load_file(path).items()},
                                                 path))
        dense = trace(fresh)
        assert same(trace(r), dense) and not same(dense, before)
        del fresh
        report = receive(r, path, "bench", "ok")
        show(report)
        assert report.version == 3
        assert same(trace(r), dense)
    finally:
        remove_shared_tensors(path)
