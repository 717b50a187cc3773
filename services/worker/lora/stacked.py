"""One fused linear's resident adapters, stacked by slot, and the hook that applies them.

Slot s holds one adapter's modules of this linear side by side along the rank: A's rows are the
modules' A's concatenated ([w, in], w = the sum of their ranks) and B is block-diagonal ([out, w]:
module j's scaled B in its own output rows and its own rank columns, zeros elsewhere). Two matmuls
then apply every segment of a fused linear (q, k and v of qkv_proj) for all the slot's rows; the
zeros add exactly nothing, and a module the adapter does not target takes no columns at all. The
stacks grow their width to the widest slot written, so memory follows the ranks in use rather
than --max-lora-rank.

With the fused CPU kernel built (kernels/lora_cpu.py) the slots are also held in its layout
(fused.py) and every call it can take runs there: one call per linear for any mix of slots,
where the torch paths below take a gather, two matmuls and a scatter, at every batch size (one
adapter's throughput included: bench/lora.py, docs/benchmarks.md issue 20). The torch paths stay the reference (set_fused_kernel(False) runs them, so the
slots stay prepacked) and the fallback where the kernel cannot be built.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from services.worker.lora import fused
from services.worker.lora.batch import LoraContext
from services.worker.model.linear import can_prepack, packed_linear, prepack

Segment = tuple[int, int, torch.Tensor, torch.Tensor]  # (lo, hi, A [r, in], scaled B [hi - lo, r])


class StackedLora:
    """The LoRA hook of one Linear (Linear.lora): `hook(x, y)` adds the active batch's deltas."""

    def __init__(self, in_features: int, out_features: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device, context: LoraContext, kernel: ModuleType | None = None):
        """kernel: backend_select.fused_kernel(device)'s module (C++ on CPU, Triton on CUDA), to
        hold the slots in its layout too and apply them there (None: the torch paths only)."""
        self.context = context
        self.fused = (fused.FusedSlots(in_features, out_features, num_slots, dtype, kernel, device)
                      if fused.usable(kernel, dtype, device) else None)
        self.use_fused = True  # False: the torch paths even with the kernel (LoraManager.set_fused_kernel)
        self.a = torch.zeros(num_slots, 0, in_features, dtype=dtype, device=device)  # [S, W, in]
        self.b = torch.zeros(num_slots, out_features, 0, dtype=dtype, device=device)  # [S, out, W]
        self.width = [0] * num_slots  # slot → the columns its adapter uses (0: none of this linear)
        # slot → its A [w, in] and B [out, w] prepacked for oneDNN (half precision on a CPU that packs
        # it: an unpacked bf16 matmul re-lays its weight out on every call); None: plain F.linear.
        self.packed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def write(self, slot: int, segments: list[Segment]) -> None:
        """Hold `segments` (one adapter's modules of this linear) in `slot`, replacing what it held."""
        width = sum(a.shape[0] for _, _, a, _ in segments)
        if width > self.a.shape[1]:
            self._grow(width)
        self.a[slot].zero_()
        self.b[slot].zero_()
        col = 0
        for lo, hi, a, b in segments:
            r = a.shape[0]
            self.a[slot, col:col + r] = a
            self.b[slot, lo:hi, col:col + r] = b
            col += r
        self.width[slot] = width
        a, b = self.a[slot, :width], self.b[slot, :, :width]
        self.packed[slot] = (prepack(a), prepack(b)) if width and can_prepack(a) else None
        if self.fused is not None:
            self.fused.write(slot, segments)

    def clear(self, slot: int) -> None:
        with torch.inference_mode():  # the stacks may have been made on the step thread, in inference mode
            self.a[slot].zero_()  # the batched path reads every slot's full width
            self.b[slot].zero_()
        self.width[slot] = 0
        self.packed[slot] = None
        if self.fused is not None:
            self.fused.clear(slot)

    def _grow(self, width: int) -> None:
        S, W, n_in = self.a.shape
        a = self.a.new_zeros(S, width, n_in)
        b = self.b.new_zeros(S, self.b.shape[1], width)
        a[:, :W], b[:, :, :W] = self.a, self.b
        self.a, self.b = a, b

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [T, in], y = the base output [T, out] → y plus each slot's delta on its rows (in place)."""
        batch = self.context.batch
        if batch is None:
            return y
        if self.fused is not None and self.use_fused and batch.order is not None and self.fused.applies(x, y):
            return self.fused.apply(x, y, batch)
        if batch.padded is not None:  # several slots: one batched matmul (measured 4x a loop of packed ones)
            return self._padded(x, y, batch.padded)
        for slot, rows in batch.groups:
            w = self.width[slot]
            if w == 0:
                continue
            packed = self.packed[slot]
            if packed is not None:
                delta = packed_linear(packed_linear(x[rows], packed[0], None), packed[1], None)  # [n, out]
            else:
                h = F.linear(x[rows].to(self.a.dtype), self.a[slot, :w])  # [n, w]
                delta = F.linear(h, self.b[slot, :, :w]).to(y.dtype)  # [n, out]
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y

    def _padded(self, x: torch.Tensor, y: torch.Tensor, p) -> torch.Tensor:
        """Every slot of the step at once: x's adapter rows as [G, L, in], two batched matmuls with
        the slots' stacks (zero columns past a slot's width add exactly nothing), the real rows'
        deltas added back."""
        G = p.slots.shape[0]
        whole = p.all_slots and G == self.a.shape[0]  # the step uses every slot: the stacks as they are
        a, b = (self.a, self.b) if whole else (self.a[p.slots], self.b[p.slots])  # [G, W, in], [G, out, W]
        xs = x.index_select(0, p.gather).to(a.dtype).view(G, p.length, -1)  # [G, L, in]
        h = torch.bmm(xs, a.transpose(1, 2))  # [G, L, W]
        delta = torch.bmm(h, b.transpose(1, 2)).view(G * p.length, -1)  # [G L, out]
        y.index_add_(0, p.rows, delta.index_select(0, p.keep).to(y.dtype))
        return y
