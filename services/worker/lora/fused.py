"""One fused linear's resident adapters in the layout of the fused CPU kernel (kernels/lora_cpu.py).

The kernel applies every slot of a step to the linear's output in one call, where the torch path
(stacked.py) takes a gather, two batched matmuls and an index_add per linear. A slot keeps its
modules' A's side by side along the rank as stacked.py does, but B is kept per segment: the
kernel multiplies each module's output rows by its own rank columns only, so the zeros of the
block-diagonal B cost nothing. The layouts grow to the widest slot written (Wp, a multiple of
16) and to the most segments one slot holds. On CUDA the same layouts feed the Triton SGMV kernel
(kernels/triton/lora_sgmv.py, chosen by backend_select.py).
"""
from __future__ import annotations

from types import ModuleType

import torch

from kernels import lora_cpu
from services.worker.lora import backend_select
from services.worker.lora.batch import LoraBatch

Segment = tuple[int, int, torch.Tensor, torch.Tensor]  # (lo, hi, A [r, in], scaled B [hi - lo, r])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(module: ModuleType | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel (backend_select.fused_kernel's: C++ on CPU, Triton on CUDA) can serve
    stacks of this dtype on this device."""
    return backend_select.serves(module, device) and dtype in DTYPES


class FusedSlots:
    """a [S, ceil(in/2), Wp, 2], b [S, Wp/2, out, 2], segs int32 [S, NSEG, 4]: lora_cpu's layouts."""

    def __init__(self, in_features: int, out_features: int, num_slots: int, dtype: torch.dtype,
                 module: ModuleType, device: torch.device = torch.device("cpu")):
        self.module = module
        self.in_features = in_features
        self.a = torch.zeros(num_slots, (in_features + 1) // 2, 0, 2, dtype=dtype, device=device)
        self.out_features = out_features
        self.b = torch.zeros(num_slots, 0, out_features, 2, dtype=dtype, device=device)
        self.segs = torch.zeros(num_slots, 0, 4, dtype=torch.int32, device=device)

    def write(self, slot: int, segments: list[Segment]) -> None:
        """Hold `segments` in `slot`, replacing what it held."""
        width = sum(a.shape[0] for _, _, a, _ in segments)
        self._grow(lora_cpu.padded_width(width), len(segments))
        wp = self.a.shape[2]
        a = self.a.new_zeros(width, self.in_features)  # [W, in]
        b = self.b.new_zeros(self.out_features, width)  # [out, W]
        segs = torch.zeros(self.segs.shape[1], 4, dtype=torch.int32)
        col = 0
        for j, (lo, hi, a_j, b_j) in enumerate(segments):
            r = a_j.shape[0]
            a[col:col + r], b[lo:hi, col:col + r] = a_j, b_j
            segs[j] = torch.tensor([lo, hi, col, col + r], dtype=torch.int32)
            col += r
        with torch.inference_mode():  # as stacked.py: the stacks may be inference tensors
            self.a[slot] = lora_cpu.pack_a(a, wp)
            self.b[slot] = lora_cpu.pack_b(b, wp)
            self.segs[slot] = segs

    def clear(self, slot: int) -> None:
        with torch.inference_mode():
            self.segs[slot].zero_()  # no segment: the kernel skips the slot's rows

    def _grow(self, wp: int, nseg: int) -> None:
        S, half_in, W, _ = self.a.shape
        if wp > W:
            a = self.a.new_zeros(S, half_in, wp, 2)
            b = self.b.new_zeros(S, wp // 2, self.out_features, 2)
            a[:, :, :W], b[:, :W // 2] = self.a, self.b
            self.a, self.b = a, b
        if nseg > self.segs.shape[1]:
            segs = self.segs.new_zeros(S, nseg, 4)
            segs[:, :self.segs.shape[1]] = self.segs
            self.segs = segs

    def applies(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether apply() takes this call (2-D rows with unit stride, the stacks' dtype)."""
        return (x.dim() == 2 and y.dim() == 2 and x.dtype == y.dtype == self.a.dtype
                and x.stride(1) == 1 and y.stride(1) == 1)

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """x [T, in], y [T, out] → y plus each slot's delta on its rows (in place)."""
        self.module.lora_apply_(x, y, self.a, self.b, self.segs, batch.order, batch.slot_groups)
        return y
