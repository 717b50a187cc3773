"""Linear layers on GGUF-quantized weights (Q8_0, Q4_1) for small batches on CPU.

The C++ kernel is kernels/cpu/quant_gemv.cpp. A GGUF block of 32 weights is
split once, at load, into its values and its scales widened to float32
(`QuantWeight.from_blocks`), so the kernel's inner loop needs no half-float
conversion. `QuantWeight.dequantize` is the torch reference and documents the
formats. The worker keeps these next to its dense weights and uses them when a
step has few rows (services/worker/model/linear.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.cpu_build import load_cpu_extension

BLOCK = 32
# GGML type name -> (kernel's qtype code, bytes per GGUF block of 32 weights)
QTYPES: dict[str, tuple[int, int]] = {"Q8_0": (0, 34), "Q4_1": (1, 20)}


def load() -> ModuleType | None:
    """The compiled module (quant_linear), or None if it cannot be built here."""
    return load_cpu_extension("quant_gemv", "quant_gemv.cpp")


@dataclass
class QuantWeight:
    """One [N, K] weight in a GGUF block format, split for the kernel.

    Q8_0 (block: fp16 d, int8 q[32]): w = d * q. qs [N, K] int8 stored as uint8; m None.
    Q4_1 (block: fp16 d, fp16 m, uint8 qs[16]): w_i = d * n_i + m with n_i the low nibble
    of byte i for i < 16 and the high nibble of byte i - 16 after. qs [N, K/2].
    d, m: [N, K/32] float32 (exact widenings of the file's fp16 scales).
    """

    qtype: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: str) -> "QuantWeight":
        """blocks: uint8 [N, K/32 * block_bytes], the file's rows as stored."""
        if qtype not in QTYPES:
            raise ValueError(f"unsupported quantized type {qtype!r} (supported: {sorted(QTYPES)})")
        size = QTYPES[qtype][1]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
            raise ValueError(f"{qtype} blocks must be uint8 [N, K/32 * {size}], got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
        N = blocks.shape[0]
        b = blocks.reshape(N, -1, size)  # [N, nb, size]
        d = b[..., 0:2].contiguous().view(torch.float16).reshape(N, -1).float()
        if qtype == "Q8_0":
            return cls(qtype, b[..., 2:].reshape(N, -1).contiguous(), d, None)
        m = b[..., 2:4].contiguous().view(torch.float16).reshape(N, -1).float()
        return cls(qtype, b[..., 4:].reshape(N, -1).contiguous(), d, m)

    @classmethod
    def cat_rows(cls, parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack weights with the same type and K along N (fused qkv, gate_up)."""
        if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            raise ValueError("only weights of one type and input size can be fused")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return cls(parts[0].qtype, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        """→ float32 [N, K]: the weights the kernel multiplies by."""
        N = self.qs.shape[0]
        d = self.d[..., None]  # [N, nb, 1]
        if self.qtype == "Q8_0":
            return (d * self.qs.view(torch.int8).reshape(N, -1, BLOCK).float()).reshape(N, -1)
        q = self.qs.reshape(N, -1, 16).to(torch.int32)
        n = torch.cat([q & 15, q >> 4], dim=-1).float()  # [N, nb, 32]
        return (d * n + self.m[..., None]).reshape(N, -1)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 module: ModuleType | None = None, float_out: bool = False) -> torch.Tensor:
    """x [T, K] @ w.dequantize()^T (+ bias) → [T, N] in x's dtype, or float32 when
    float_out (float32 math either way)."""
    module = module or load()
    if module is None:
        raise RuntimeError("the CPU quantized-linear kernel is not built")
    return module.quant_linear(x, w.qs, w.d, w.m, QTYPES[w.qtype][0], bias, float_out)
