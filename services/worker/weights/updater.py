"""The three weight-update paths (SGLang's names), each load → stage → swap, timed.

- from_disk: an HF safetensors directory or a GGUF file, read by the worker's own loader
  (load_checkpoint), of the serving architecture (architecture.py); a GGUF's quantized blocks
  come along and the backend runs on them, as at start-up.
- from_tensor: named tensors in process (the in-process Engine), or a safetensors file a
  trainer on the same host wrote to shared memory (shared_tensors.py, mapped without a copy).
- from_distributed: tensors rank 0 of a joined torch.distributed group broadcasts (distributed.py).

All three are transactional: staging (staging.py) checks everything against the serving model
before the swap (swap.py) touches it; any failure raises WeightUpdateError with the old weights
serving, bit-identical, and runner.weights_version unchanged. Callers run them between steps,
on the thread that runs the steps.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from services.worker.loader.checkpoint import load_checkpoint
from services.worker.weights.architecture import check_same_architecture
from services.worker.weights.errors import WeightUpdateError
from services.worker.weights.report import WeightUpdateReport
from services.worker.weights.shared_tensors import map_shared_tensors
from services.worker.weights.staging import stage
from services.worker.weights.swap import swap_in


def update_from_disk(runner, path: str) -> WeightUpdateReport:
    t0 = time.perf_counter()
    try:
        checkpoint = load_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - any reader's error (OSError, ValueError, SafetensorError, ...)
        raise WeightUpdateError(f"cannot load new weights from {path!r}: {type(e).__name__}: {e}") from e
    check_same_architecture(runner.model_config, checkpoint.config, path)
    return _stage_and_swap(runner, "disk", path, checkpoint.tensors, checkpoint.quantized, t0)


def update_from_tensor(runner, tensors: Mapping[str, torch.Tensor] | None = None,
                       shm_path: str | None = None) -> WeightUpdateReport:
    """Exactly one of tensors (HF name → tensor, in process) and shm_path (a shared-memory file)."""
    if (tensors is None) == (shm_path is None):
        raise WeightUpdateError("give either tensors or shm_path")
    t0 = time.perf_counter()
    named = map_shared_tensors(shm_path) if shm_path is not None else tensors
    return _stage_and_swap(runner, "tensor", shm_path or "", named, None, t0)


def update_from_distributed(runner, groups, group_name: str, names: Sequence[str],
                            dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]) -> WeightUpdateReport:
    """groups: the runner's distributed.UpdateGroups."""
    t0 = time.perf_counter()
    received = groups.receive(group_name, names, dtypes, shapes)
    return _stage_and_swap(runner, "distributed", group_name, received, None, t0)


def _stage_and_swap(runner, path: str, source: str, tensors: Mapping[str, torch.Tensor], quantized,
                    t0: float) -> WeightUpdateReport:
    t1 = time.perf_counter()
    staged = stage(runner, tensors, quantized)
    t2 = time.perf_counter()
    version = swap_in(runner, staged, source or path)
    t3 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return WeightUpdateReport(path=path, version=version, num_tensors=len(tensors), bytes=nbytes,
                              load_seconds=t1 - t0, validate_seconds=t2 - t1, swap_seconds=t3 - t2, source=source)
