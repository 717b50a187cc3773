"""Linear layers on quantized weights on CPU: GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K blocks and int8 per-channel weights, at any batch size.

The C++ kernel is kernels/cpu/quant_gemv.cpp. A weight is split once, at load, into the
kernel's layout (`QuantWeight.from_blocks`, kernels/quant_formats.py: packed values plus
float32 scales and mins computed as gguf computes them), so the inner loop unpacks
values and needs no half-float or 6-bit scale decoding. `QuantWeight.dequantize` is the
torch reference, bit-exact with `gguf.quants.dequantize`. `quant_linear` computes steps of
at most FUSED_MAX_ROWS rows as fused dot products on the packed values and larger ones as
dequantized tiles times a GEMM, inside one call: no dequantized copy of the weight is kept.

A fused row's result never depends on the rows beside it (each output's order of operations
is fixed), so a verify step's rows equal one-row decode steps'. The GEMM's sums are its own:
the one-call decode stack (decode_stack.cpp) stays on the fused kernel at every batch size.
Measurements: bench/quant_kernels.py, bench/results/quant_kernels-2026-12-03.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kernels import quant_formats
from kernels.cpu_build import load_cpu_extension
from kernels.quant_formats import FORMATS, GROUP, Format

BLOCK = GROUP
FUSED_MAX_ROWS = 8  # quant_gemv.h's kMaxRows: more rows go through dequantized tiles and a GEMM
# GGML type name -> (kernel's qtype code, bytes per GGUF block): the GGUF types a file's
# tensors may have for the kernel to use them.
QTYPES: dict[str, tuple[int, int]] = {n: (f.code, f.type_size) for n, f in FORMATS.items() if f.block}


def load() -> ModuleType | None:
    """The compiled module (quant_linear), or None if it cannot be built here."""
    return load_cpu_extension("quant_gemv", "quant_gemv.cpp")


@dataclass
class QuantWeight:
    """One [N, K] weight in the kernel's layout (kernels/quant_formats.py's docstring).

    qtype: a GGML type name (QTYPES) or "int8"; qs: uint8 [N, K / 32 * group bytes];
    d: float32 [N, K / scale group]; m: float32 [N, K / 32] for the formats with a min, else None.
    """

    qtype: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def format(self) -> Format:
        return FORMATS[self.qtype]

    @property
    def code(self) -> int:
        """The kernel's qtype argument (quant_linear, DecodeStack.add_linear)."""
        return self.format.code

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] // self.format.group_bytes * GROUP

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed values, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_split(cls, qtype: str, split: quant_formats.Split) -> "QuantWeight":
        f = FORMATS[qtype]
        qs = torch.from_numpy(quant_formats.pack_values(split.v, f.bits))
        m = None if split.m is None else torch.from_numpy(np.ascontiguousarray(split.m, dtype=np.float32))
        return cls(qtype, qs, torch.from_numpy(np.ascontiguousarray(split.d, dtype=np.float32)), m)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: str) -> "QuantWeight":
        """blocks: uint8 [N, K / block * type_size], a GGUF tensor's rows as stored."""
        if qtype not in QTYPES:
            raise ValueError(f"unsupported quantized type {qtype!r} (supported: {sorted(QTYPES)}); "
                             f"requantize the file to one of them (radixmesh quantize)")
        f = FORMATS[qtype]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.type_size:
            raise ValueError(f"{qtype} blocks must be uint8 [N, K/{f.block} * {f.type_size}], got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
        return cls.from_split(qtype, quant_formats.split_gguf(blocks.numpy(), qtype))

    @classmethod
    def int8_per_channel(cls, weight: torch.Tensor) -> "QuantWeight":
        """weight float [N, K] (K a multiple of 32) → symmetric int8 with one float32 scale per
        output row (rounding rule: quant_formats.int8_per_channel)."""
        return cls.from_split("int8", quant_formats.int8_per_channel(weight))

    @classmethod
    def cat_rows(cls, parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack weights with the same type and K along N (fused qkv, gate_up)."""
        if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            raise ValueError("only weights of one type and input size can be fused")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return cls(parts[0].qtype, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def row_slice(self, start: int, length: int) -> "QuantWeight":
        """Output rows [start, start + length) as a weight of their own (a tensor-parallel shard of a
        column-parallel linear), rows past N all zeros (scale 0, min 0: they compute 0)."""
        def rows(t: torch.Tensor) -> torch.Tensor:
            part = t[start:start + length]
            pad = length - part.shape[0]
            return torch.cat([part, part.new_zeros((pad, *t.shape[1:]))]) if pad else part.contiguous()
        return QuantWeight(self.qtype, rows(self.qs), rows(self.d), None if self.m is None else rows(self.m))

    def column_slice(self, start: int, length: int) -> "QuantWeight":
        """Input columns [start, start + length) (a row-parallel linear's shard): whole groups of 32,
        sliced in the packed layout with no dense copy. ValueError when they cut a group."""
        f = self.format
        if start % GROUP or length % GROUP or start + length > self.shape[1]:
            raise ValueError(f"columns [{start}, {start + length}) of a {self.qtype} weight of "
                             f"{self.shape[1]} columns do not fall on groups of {GROUP}")
        g0, g1 = start // GROUP, (start + length) // GROUP  # packed groups
        s0, s1 = start // f.scale_group, (start + length) // f.scale_group
        m = None if self.m is None else self.m[:, g0:g1].contiguous()
        return QuantWeight(self.qtype, self.qs[:, g0 * f.group_bytes:g1 * f.group_bytes].contiguous(),
                           self.d[:, s0:s1].contiguous(), m)

    def dequantize(self) -> torch.Tensor:
        """→ float32 [N, K]: the weights the kernel multiplies by (bit-exact with gguf's dequantize)."""
        return quant_formats.dequantize(self.format, self.qs, self.d, self.m)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 module: ModuleType | None = None, float_out: bool = False) -> torch.Tensor:
    """x [T, K] @ w.dequantize()^T (+ bias) → [T, N] in x's dtype, or float32 when float_out.
    T <= FUSED_MAX_ROWS: float32 math on the packed values. More rows: tiles of the weight
    dequantized to bfloat16 (x bfloat16 on a CPU with bf16 matmul) or float32, times x."""
    module = module or load()
    if module is None:
        raise RuntimeError("the CPU quantized-linear kernel is not built")
    return module.quant_linear(x, w.qs, w.d, w.m, w.code, bias, float_out)


class Int8Activations:
    """The compiled module with int8 activations on (the worker's --quant-activations int8):
    every quant_linear call of at most FUSED_MAX_ROWS rows on Q4_1/Q8_0 weights quantizes x per
    group of 32 and multiplies with integer dot products (kernels/cpu/int8_activations*.h). Only
    where `module.int8_activations()` says the build has them."""

    def __init__(self, module: ModuleType) -> None:
        if not module.int8_activations():
            raise ValueError("this build of quant_gemv has no int8 activations (they need AVX2 or AVX512-VNNI)")
        self.module = module

    def quant_linear(self, *args, **kwargs) -> torch.Tensor:
        return self.module.quant_linear(*args, int8_activations=True, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.module, name)
