"""Load a llama.cpp GGUF file into a `Checkpoint`: config from metadata, dequantized float32 tensors
renamed to Hugging Face names and laid out as HF expects."""
from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kernels.quant_gemv import QTYPES, QuantWeight
from services.worker.loader import gguf_archs
from services.worker.loader.checkpoint import Checkpoint
from services.worker.model.config import ModelConfig
from services.common.gguf_reader import FastGGUFReader
from services.common.model_path import model_id

# Float types, the types whose dequantization is round-trip tested, and every type the quantized
# kernels compute on (kernels.quant_gemv.QTYPES: one list, so a format the kernels gain loads too).
SUPPORTED_TYPES = frozenset({QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1,
                             QType.Q5_0, QType.Q5_1} | {QType[name] for name in QTYPES})

_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's encoding of Llama-3.1 rope scaling


def load_gguf(path: str, dense_quantized: bool = True, part=None) -> Checkpoint:
    """Read `path` (a GGUF of an architecture in gguf_archs.ARCHS) into float32 HF-named tensors.

    Matrices in a kernel format (QTYPES) also come as their blocks (Checkpoint.quantized);
    dense_quantized False leaves their float32 values out (--quantization gguf holds only the
    blocks, so they are never dequantized whole).

    part: a worker group's rank (load_checkpoint): each tensor, dense or blocks, is cut to its
    part on the thread that read it, so only the parts stay resident.

    Raises FileNotFoundError for a missing file and ValueError for a file that is not GGUF, an
    unsupported architecture, an unknown tensor name or an unsupported tensor type.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        reader = FastGGUFReader(path)
    except ValueError as e:  # bad magic / version
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e
    meta = reader.fields
    arch_name = _scalar(meta, "general.architecture")
    arch = gguf_archs.ARCHS.get(arch_name)
    if arch is None:
        raise ValueError(f"{path}: architecture {arch_name!r} is not supported "
                         f"(supported: {sorted(gguf_archs.ARCHS)})")
    by_name = {t.name: t for t in reader.tensors}
    config = _config_from_metadata(meta, arch_name, arch, by_name, path)

    jobs: list[tuple[str, gguf.ReaderTensor, int | None]] = []  # (gguf name, tensor, heads to unpermute)
    for name, t in by_name.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling above
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
        jobs.append((name, t, gguf_archs.permute_heads(arch, name, config)))

    rank_part = part(config) if part is not None else None

    def read(job: tuple[str, gguf.ReaderTensor, int | None]) -> tuple[dict, dict]:
        """One GGUF tensor → its HF tensors (dense, blocks), cut to the rank's part when there is one."""
        name, t, heads = job
        values, raw = _dequantize(t, heads, dense_quantized)
        dense, blocks = {}, {}
        for hf, v, b in gguf_archs.hf_tensors(arch, name, values, raw, config, path):
            if b is None or dense_quantized:
                dense[hf] = torch.from_numpy(v)
            if b is not None:
                blocks[hf] = QuantWeight.from_blocks(torch.from_numpy(b), t.tensor_type.name)
        if rank_part is not None:
            dense, blocks = rank_part.take(dense), rank_part.take(blocks)
        return dense, blocks

    # gguf's numpy kernels release the GIL on large arrays, so tensors dequantize in parallel.
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantWeight] = {}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for dense, blocks in pool.map(read, jobs):
            tensors.update(dense)
            quantized.update(blocks)
    if arch.moe:
        gguf_archs.stack_experts(tensors)
    return Checkpoint(config=config, tensors=tensors, source=path, quantized=quantized, part=rank_part)


def _dequantize(t: gguf.ReaderTensor, n_heads: int | None,
                dense: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """(float32 array of HF shape [out, in] (or [n]), and for a matrix in a kernel format (QTYPES)
    its blocks in HF row order, else None); never views into the read-only file mapping. Without
    `dense`, a matrix with blocks gets an empty [out, 0] array instead of its values."""
    raw = t.data
    if n_heads is not None:
        # Undo llama.cpp's row permutation on the still-quantized rows: blocks never cross a row,
        # so this moves fewer bytes than permuting the float32 result, and the copy is needed anyway.
        rows = raw.shape[0]
        if rows % (2 * n_heads):
            raise ValueError(f"{t.name}: {rows} rows do not split into {n_heads} heads of even size")
        raw = raw.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)
    keep = t.tensor_type.name in QTYPES and raw.ndim == 2
    blocks = np.array(raw, dtype=np.uint8) if keep else None
    if keep and not dense:
        return np.empty((raw.shape[0], 0), dtype=np.float32), blocks  # rows only: hf_tensors splits fused ones
    out = gguf.quants.dequantize(raw, t.tensor_type)
    if not out.flags.writeable:  # F32 comes back as a view of the mapping
        out = out.copy()
    return out.astype(np.float32, copy=False), blocks


def _scalar(meta: dict[str, gguf.ReaderField], key: str, default: Any = None) -> Any:
    field = meta.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # Shortest decimal that round-trips through float32: 1e-05, not 9.999999747378752e-06.
        value = float(str(np.float32(value)))
    return value


def _config_from_metadata(meta: dict[str, gguf.ReaderField], arch: str, spec: gguf_archs.GGUFArch,
                          tensors: dict[str, gguf.ReaderTensor], path: str) -> ModelConfig:
    def key(name: str, default: Any = None) -> Any:
        return _scalar(meta, f"{arch}.{name}", default)

    required = ["block_count", "embedding_length", "attention.head_count"]
    required += [] if spec.moe else ["feed_forward_length"]  # sparse everywhere: no dense size
    missing = [f"{arch}.{k}" for k in required if key(k) is None]
    if missing or "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: incomplete GGUF, missing {missing or ['token_embd.weight']}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    theta = float(key("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(meta, arch, tensors, theta, head_dim, path)
    # llama.cpp stops on every end-of-generation token; eot/eom exist in Llama-3 style files.
    eos = [_scalar(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
    bos = _scalar(meta, "tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # ggml order: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", 0)),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=any(n.endswith(".attn_q.bias") for n in tensors),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        architecture=spec.architecture,
        name=model_id(path),
    )
    try:
        fields = spec.config_fields(key, set(tensors), config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return dataclasses.replace(config, **fields)


def _rope_scaling(meta: dict[str, gguf.ReaderField], arch: str, tensors: dict[str, gguf.ReaderTensor],
                  theta: float, head_dim: int, path: str) -> dict[str, Any] | None:
    """HF-style rope_scaling dict from the `rope.scaling.*` keys or a `rope_freqs` tensor."""
    if _ROPE_FREQS in tensors:
        factors = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        return llama3_scaling_from_factors(np.asarray(factors, dtype=np.float64), theta, head_dim, path)
    kind = _scalar(meta, f"{arch}.rope.scaling.type")
    factor = _scalar(meta, f"{arch}.rope.scaling.factor") or _scalar(meta, f"{arch}.rope.scale_linear")
    kind = kind or ("linear" if factor else "none")  # old files only wrote rope.scale_linear
    if kind == "none" or not factor or float(factor) == 1.0:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = _scalar(meta, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3.1 rope scaling (what llama.cpp stores as `rope_freqs`)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ratio = scaling["original_max_position_embeddings"] * inv_freq / (2 * np.pi)  # old_ctx / wavelen
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                                path: str = "<gguf>") -> dict[str, Any] | None:
    """Invert `llama3_factors`: GGUF keeps only the factors, the model wants the HF parameters.

    Only old_ctx/low and old_ctx/high are observable, so old_ctx is fixed at Llama-3's 8192 and the
    two others fitted to the smooth region; the fit is checked by recomputing the factors.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_ctx = 8192
    ratio = old_ctx * inv_freq / (2 * np.pi)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    mid = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if mid.sum() < 2:
        raise ValueError(f"{path}: rope_freqs has too few interpolated frequencies to recover llama3 scaling")
    slope, intercept = np.polyfit(ratio[mid], smooth[mid], 1)  # smooth = (ratio - low) / (high - low)
    low = -intercept / slope
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
               "high_freq_factor": float(low + 1.0 / slope), "original_max_position_embeddings": old_ctx}
    if not np.allclose(llama3_factors(scaling, theta, head_dim), factors, rtol=1e-4, atol=1e-5):
        raise ValueError(f"{path}: rope_freqs does not follow Llama-3 rope scaling; not supported")
    return scaling
