"""The GGUF weight formats `radixmesh quantize` writes, and which type each tensor gets."""
from __future__ import annotations

import gguf
import numpy as np

from services.quantize.kquants import QUANTIZERS, QK_K

QType = gguf.GGMLQuantizationType
# `gguf.quants.quantize` implements these; the k-quants are services/quantize/kquants.py's.
GGUF_QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = tuple(QUANTIZERS)
TYPES = ("F32", "F16", "BF16") + GGUF_QUANTIZED + K_QUANTS
# A k-quant needs rows of a multiple of 256 values; a tensor whose rows are not takes llama.cpp's
# fallback type instead (its llama-quant.cpp does the same: SmolLM2's hidden size is 576).
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
EMBEDDING_NAMES = ("token_embd.weight", "output.weight")


def check_type(name: str, flag: str = "--type") -> str:
    if name not in TYPES:
        raise ValueError(f"{flag} must be one of {list(TYPES)}, got {name!r}")
    return name


def tensor_type(name: str, shape: tuple[int, ...], target: str, embedding: str) -> str:
    """The type tensor `name` (numpy shape, rows last) is written in: 1-D tensors (norms, biases) and
    tensors too small to block stay F32; the embedding and output head take `embedding`; the rest
    take `target`, or its fallback where a row is no whole number of blocks."""
    if len(shape) < 2:
        return "F32"
    wanted = embedding if name in EMBEDDING_NAMES else target
    for candidate in (wanted, K_FALLBACK.get(wanted, "F16"), "F16"):
        if candidate in ("F32", "F16", "BF16") or shape[-1] % gguf.GGML_QUANT_SIZES[QType[candidate]][0] == 0:
            return candidate
    return "F16"


def encode(data: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [..., K] → the tensor's bytes in qtype (uint8 [..., K / block * type_size]), or the
    float array itself for F32/F16/BF16."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype in K_QUANTS:
        from services.quantize.kquants import quantize_rows
        rows = data.reshape(-1, data.shape[-1])
        return quantize_rows(rows, qtype).reshape(*data.shape[:-1], -1)
    if qtype == "F32":
        return data
    return gguf.quants.quantize(data, QType[qtype])


def block_size(qtype: str) -> int:
    return QK_K if qtype in K_QUANTS else gguf.GGML_QUANT_SIZES[QType[qtype]][0]
