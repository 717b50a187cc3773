"""The worker's side of same-host updates: map a safetensors file a trainer wrote to shared memory.

The format is safetensors (services/common/weight_sync.write_shared_tensors): an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then raw
bytes. Nothing in it is code (no pickle). The file is mapped privately (copy-on-write: the
worker never writes the trainer's file) and every tensor is a view into the mapping
(torch.frombuffer): no copy until staging casts them into the serving dtype. A tensor whose
offset is not aligned to its element size is copied out instead. The header is checked
before any tensor is made: known dtypes, shapes of non-negative ints, byte ranges inside the
file and of the size the shape says.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct

import torch

from services.worker.weights.errors import WeightUpdateError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # safetensors' own limit


def map_shared_tensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file → name → tensor viewing the file's bytes (the mapping lives as long as
    they do). Raises WeightUpdateError for a missing, truncated or malformed file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, base = _read_header(f, size, path)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    except OSError as e:
        raise WeightUpdateError(f"cannot read shared tensors {path!r}: {e}") from e
    return {name: _tensor(mapped, name, info, base, size, path) for name, info in header.items()
            if name != "__metadata__"}


def _read_header(f, size: int, path: str) -> tuple[dict, int]:
    """→ (the JSON header, the offset where the data starts)."""
    if size < 8:
        raise WeightUpdateError(f"{path}: {size} bytes is not a safetensors file")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(_MAX_HEADER, size - 8):
        raise WeightUpdateError(f"{path}: header of {length} bytes does not fit in the file ({size} bytes)")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightUpdateError(f"{path}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise WeightUpdateError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + length


def _tensor(mapped, name: str, info: object, base: int, size: int, path: str) -> torch.Tensor:
    """One header entry → its tensor, a view into `mapped` when aligned."""
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise WeightUpdateError(f"{path}: {name}: unknown or missing dtype in {info!r}")
    dtype, shape, offsets = _DTYPES[info["dtype"]], info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise WeightUpdateError(f"{path}: {name}: bad shape {shape!r}")
    numel, itemsize = math.prod(shape), torch.empty((), dtype=dtype).element_size()
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] and base + offsets[1] <= size
            and offsets[1] - offsets[0] == numel * itemsize):
        raise WeightUpdateError(f"{path}: {name}: byte range {offsets!r} does not hold {shape} {info['dtype']} "
                                f"inside the file")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    start = base + offsets[0]
    if start % itemsize:  # misaligned for its dtype: copy the bytes out
        raw = torch.frombuffer(bytearray(mapped[start:start + numel * itemsize]), dtype=torch.uint8)
        return raw.view(dtype).view(shape)
    return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=start).view(shape)
