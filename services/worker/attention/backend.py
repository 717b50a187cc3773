"""What an attention backend implements (torch reference, cpu, triton, flashinfer: the registry below).

Besides attention itself (prepare, forward), a backend owns the tuning of the device it runs
on: `attach` applies it once to the built model, and `one_call_step` runs a whole pure-decode
step in one call where the backend has such a path, the runner running every other step op by op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from services.worker.attention.batch_layout import BatchLayout
from services.worker.kv_pool import KVPool
from services.worker.model.layer_attention import LayerAttention

if TYPE_CHECKING:
    from services.worker.config import WorkerConfig
    from services.worker.loader.checkpoint import Checkpoint


@dataclass(frozen=True)
class Attached:
    """What a backend's attach did to the model (the worker's ready line says it)."""

    quantized_weights: int = 0  # weights that run on the checkpoint's quantized blocks in small steps
    one_call_rows: int = 0  # pure-decode steps of at most this many items run as one call (one_call_step)


@dataclass(frozen=True)
class DecodeStep:
    """A decode step in plain ints, for a backend's one-call path: no per-step layout or
    attention-metadata tensors. One token per row; a verify item (speculation, jump-forward)
    is several rows sharing a page-table row at consecutive positions, and row j attends over
    positions <= its own, the draft's earlier rows included (written before any row attends)."""

    token_ids: list[int]  # [B]
    positions: list[int]  # [B] each token's position
    rows: list[int]  # [B] each token's row of page_table
    sampled: list[int]  # indices into B whose logits come back
    page_table: torch.Tensor  # [N, P] int64: the runner's, row r holds request r's pages
    page_size: int
    pool: KVPool


class AttentionBackend(Protocol):
    def attach(self, model: torch.nn.Module, config: WorkerConfig, checkpoint: Checkpoint,
               prepacked: bool) -> Attached:
        """Once, after the runner built the model (weights loaded, linears prepacked when
        `prepacked`, layer ops installed): this backend's tuning of the process and the model."""

    def one_call_step(self, step: DecodeStep, before_compute: Callable[[], None]) -> torch.Tensor | None:
        """The whole step in one call, KV written → float32 logits [len(step.sampled), V], calling
        before_compute right before its compute; None when it does not take the step (nothing
        done): the runner runs it op by op. Only called for steps of at most attach's one_call_rows
        tokens, or of at most the runner's verify_max_rows when a verify item is in it."""

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        """Build per-step index tensors once; every layer's `forward` reuses them."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        """Write this step's k, v [T, Hkv, D] into the pool, attend q [T, H, D]
        causally over each request's KV (as `variant` says, when given), and return [T, H, D]."""


# name -> (factory "module:attr", keyword arguments)
_BACKENDS: dict[str, tuple[str, dict]] = {
    "torch": ("services.worker.attention.torch_backend:TorchAttentionBackend", {}),
    # torch with the C++ paged decode kernel, plus the CPU worker's tuning and one-call decode steps
    "cpu": ("services.worker.attention.cpu_backend:CpuBackend", {}),
    "triton": ("services.worker.attention.triton_backend:TritonAttentionBackend", {}),  # paged Triton kernels
    "flashinfer": ("services.worker.attention.flashinfer_backend:create", {}),  # CUDA; else triton, with a warning
}


def create_backend(name: str, scale: float, sliding_window: int | None = None) -> AttentionBackend:
    """sliding_window: each query attends only to the last that many positions (None: all)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    target, kwargs = _BACKENDS[name]
    module, cls = target.split(":")
    import importlib
    return getattr(importlib.import_module(module), cls)(scale=scale, sliding_window=sliding_window, **kwargs)
