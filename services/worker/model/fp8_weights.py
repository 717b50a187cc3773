"""FP8 E4M3 weights (`--quantization fp8`): one linear weight as float8_e4m3fn bytes with one
float32 scale per output row, and the linear layer computed on them.

Quantizing (`Fp8Weight.quantize`): per output row, scale = amax / 448 (e4m3fn's largest
finite value), bytes = round-to-nearest-even(w / scale) clamped to +-448, so a row's largest
weight lands on 448 and nothing saturates into e4m3fn's NaN. Zero rows get scale 1 (their bytes
are zeros whatever the scale). The weight then costs N*K bytes plus 4*N, about half of
bfloat16's, and nothing dense stays resident (Linear.set_quant_only).

Computing (`Fp8Weight.linear`), by device:
- CUDA: the Triton W8A16 GEMM (kernels/triton/fp8_gemm.py): the bytes widened in registers,
  float32 sums, the scales applied once at the end.
- CPU: torch, one call at a time: the whole [N, K] weight is widened to x's dtype, F.linear
  multiplies, and the row scales multiply the float32 output. No widened copy is kept between
  calls (that would be the dense copy this format exists to avoid). torch's own float8 ->
  bfloat16 conversion is scalar (measured 3.7 ms for a 3072 x 576 weight on this 2-core Xeon);
  `widen` instead moves each byte's bits into the target format with three vectorized integer
  ops and one exact power-of-two multiply (0.4 ms), the same trick the Triton kernel uses.
  Measured on SmolLM2-135M's four layer shapes, one layer's linears: batch 1 bfloat16 1.4 ms
  against 0.35 ms dense, batch 256 2.9 ms against 1.1 ms. A float16 GEMM on the float16 reading
  of the bytes (value / 2^8) was faster at batch 1 (0.8 ms) but 7.9 ms at 256 on this CPU, and
  it overflows for activations past 65504: not taken. A whole decode step (batch 1, bfloat16,
  one measurement on the shared machine): ~89 ms, against ~60 ms for prepacked dense bfloat16
  op by op (--quantization none) and ~15 ms for the default (the file's Q4_1 blocks in the
  one-call decode stack, which does not read FP8). FP8 on CPU works; it is not fast.

The widening is exact (every finite e4m3 value is a bfloat16, float16 and float32), so on CPU
the only differences from the float32 reference are the GEMM's own rounding of its output to x's
dtype and a second rounding after the scale (the Triton kernel rounds once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
QTYPE = "fp8_e4m3"

# int16 masks that keep a shifted byte's sign at bit 15 and its exponent and mantissa below,
# written as negative ints because int16 tensors take no literal above 0x7FFF:
_BF16_MASK = -0x7810  # 0x87F0: bfloat16 bits s 000 eeee mmm 0000 (value * 2^-120)
_FP16_MASK = -0x4080  # 0xBF80: float16 bits s 0 eeee mmm 0000000 (value * 2^-8)


@dataclass
class Fp8Weight:
    """One [N, K] linear weight: w float8_e4m3fn [N, K] (contiguous), scale float32 [N]; the weight
    it stands for is w.float() * scale[:, None]. Both on the device the layer computes on."""

    w: torch.Tensor
    scale: torch.Tensor
    qtype: str = QTYPE

    def __post_init__(self) -> None:
        if self.w.dim() != 2 or self.w.dtype != E4M3 or not self.w.is_contiguous():
            raise ValueError(f"w must be contiguous float8_e4m3fn [N, K], got {list(self.w.shape)} {self.w.dtype}")
        if self.scale.shape != (self.w.shape[0],) or self.scale.dtype != torch.float32:
            raise ValueError(f"scale must be float32 [{self.w.shape[0]}], got {list(self.scale.shape)} "
                             f"{self.scale.dtype}")

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Fp8Weight":
        """weight float [N, K] on any device → its per-row e4m3 form on that device (module docstring)."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight must be a float [N, K], got {list(weight.shape)} {weight.dtype}")
        w = weight.detach().float()
        amax = w.abs().amax(dim=1)  # [N]
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # [N]
        q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)  # [N, K], round to nearest even
        return cls(q.contiguous(), scale.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes: one per weight plus the row scales."""
        return self.w.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """→ float32 [N, K]: the weights the layer multiplies by."""
        return self.w.float() * self.scale[:, None]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False) -> torch.Tensor:
        """x [T, K] @ dequantize().T (+ bias) → [T, N] in x's dtype (float32 when float_out):
        the Triton kernel on CUDA, the torch path elsewhere (module docstring)."""
        if x.is_cuda:
            from kernels.triton.fp8_gemm import fp8_linear
            return fp8_linear(x, self.w, self.scale, bias, float_out=float_out)
        return torch_linear(x, self.w, self.scale, bias, float_out)


def widen(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w float8_e4m3fn [N, K] → the same values in dtype (float32/bfloat16/float16), exactly, via
    their bits: the sign-extended byte shifted so its exponent and mantissa sit under the
    target's (bfloat16: value * 2^-120; float16: value * 2^-8), masked, then multiplied back by
    the power of two. NaN bytes (never written by quantize) come out finite."""
    h = w.view(torch.int8).to(torch.int16)  # sign-extended: bit 7 → bits 7..15
    if dtype == torch.bfloat16:
        h.bitwise_left_shift_(4).bitwise_and_(_BF16_MASK)
        return h.view(torch.bfloat16).mul_(2.0 ** 120)
    h.bitwise_left_shift_(7).bitwise_and_(_FP16_MASK)
    half = h.view(torch.float16)
    if dtype == torch.float16:
        return half.mul_(256.0)
    if dtype == torch.float32:
        return half.float().mul_(256.0)
    raise ValueError(f"no widening of float8 weights to {dtype}")


def torch_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 float_out: bool = False) -> torch.Tensor:
    """The CPU path: x [T, K] @ (w * scale).T (+ bias) → [T, N] in x's dtype (float32 when
    float_out), with the weight widened for this call only."""
    y = F.linear(x, widen(w, x.dtype)).float().mul_(scale)  # [T, N] float32
    if bias is not None:
        y += bias.float()
    return y if float_out else y.to(x.dtype)
