"""A loaded checkpoint (config + HF-named float32 tensors) and the path dispatcher."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from services.worker.model.config import ModelConfig

if TYPE_CHECKING:
    from services.worker.parallel.rank_part import RankPart


@dataclass
class Checkpoint:
    """Everything a model needs to be built, independent of the file format.

    `tensors` maps Hugging Face Llama/Qwen2 parameter names (`model.embed_tokens.weight`,
    `model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight` only when the head is
    not tied) to contiguous float32 tensors in HF layout ([out, in] for linear weights).
    `source` is the path the checkpoint was read from.

    `quantized` holds, for the 2-D weights a GGUF stores in a format the quantized kernels
    compute on (kernels.quant_gemv.QTYPES), the file's own blocks under the same names and row
    order (a `kernels.quant_gemv.QuantWeight`); the worker runs small batches on them
    (--quantization auto), or only them (gguf: their float32 values are then not in `tensors`).
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    source: str
    quantized: dict = field(default_factory=dict)  # HF name -> QuantWeight
    # A worker group's rank: `tensors` and `quantized` hold only this RankPart's part of the
    # checkpoint (services/worker/parallel/rank_part.py), renamed and sliced; `config` stays the
    # whole model's. None: the whole checkpoint.
    part: RankPart | None = None


def load_checkpoint(path: str, quantization: str = "auto",
                    part: Callable[[ModelConfig], RankPart] | None = None) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face directory (config.json + *.safetensors).

    quantization: the worker's --quantization; under gguf a GGUF's quantized matrices come as
    their blocks only (Checkpoint.quantized), with no float32 copy in `tensors`.
    part: a worker group's rank, given the whole model's config → the RankPart it holds; each
    tensor is cut to it as it is read, so the whole checkpoint is never resident.

    Raises FileNotFoundError when `path` does not exist (or a directory lacks config.json)
    and ValueError for a file that is not GGUF or holds an unsupported architecture/quant type.

    Loads on a thread of its own, so that the caller's thread starts no OpenMP team that would
    slow the step thread's (services/worker/omp_team.py).
    """
    from services.worker.omp_team import on_own_thread
    return on_own_thread(_load, path, quantization, part)


def _load(path: str, quantization: str, part) -> Checkpoint:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (expected a .gguf file or a HF directory)")
    if os.path.isdir(path):
        from services.worker.loader.hf_loader import load_hf_dir

        return load_hf_dir(path, part)
    if path.endswith(".gguf") or _has_gguf_magic(path):
        from services.worker.loader.gguf_loader import load_gguf

        return load_gguf(path, dense_quantized=quantization != "gguf", part=part)
    raise ValueError(
        f"unsupported model file {path!r}: expected a .gguf file or a directory with config.json + *.safetensors")


def _has_gguf_magic(path: str) -> bool:
    # Files downloaded under other names (blobs in a cache) are still recognised by content.
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
