"""The GGUF weight formats `radixmesh quantize` writes, and which type each tensor gets."""
from __future__ import annotations

import gguf
import numpy as np

from services.quantize.kquants import QUANTIZERS, QK_K

QType = gguf.GGMLQuantizationType
# `gguf.quants.quantize` implements these; the k-quants are services/quantize/kquants.py's.
GGUF_QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = tuple(QUANTIZERS)
# llama.cpp's _M mixes: the k-quant, with token_embd/output and, in the layers use_more_bits picks,
# attn_v and ffn_down at Q6_K (llama-quant.cpp's rules for LLAMA_FTYPE_MOSTLY_Q4_K_M / Q5_K_M).
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
TYPES = ("F32", "F16", "BF16") + GGUF_QUANTIZED + K_QUANTS + tuple(MIXES)
# A k-quant needs rows of a multiple of 256 values; a tensor whose rows are not takes llama.cpp's
# fallback type instead (its llama-quant.cpp does the same: SmolLM2's hidden size is 576).
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
EMBEDDING_NAMES = ("token_embd.weight", "output.weight")


TENSOR_TYPES = tuple(t for t in TYPES if t not in MIXES)  # what one tensor can be (--embedding-type)


def check_type(name: str, flag: str = "--type", allowed: tuple[str, ...] = TYPES) -> str:
    if name not in allowed:
        raise ValueError(f"{flag} must be one of {list(allowed)}, got {name!r}")
    return name


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down a _M mix keeps at Q6_K: the first and
    last eighth, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _mix_type(name: str, target: str, n_layers: int) -> str:
    if name in EMBEDDING_NAMES:
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), n_layers):
        return "Q6_K"
    return MIXES[target]


def tensor_type(name: str, shape: tuple[int, ...], target: str, embedding: str, n_layers: int = 0) -> str:
    """The type tensor `name` (numpy shape, rows last) is written in: 1-D tensors (norms, biases) and
    tensors too small to block stay F32; the embedding and output head take `embedding`; the rest
    take `target`, or its fallback where a row is no whole number of blocks. A mix (Q4_K_M) decides
    per tensor (n_layers: the model's block count)."""
    if len(shape) < 2:
        return "F32"
    if target in MIXES:
        wanted = _mix_type(name, target, n_layers)
    else:
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
