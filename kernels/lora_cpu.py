"""Every LoRA slot of a step applied to one linear's output in one call on CPU
(kernels/cpu/lora_apply.cpp), its weight layouts, and its torch reference.

A mixed multi-LoRA step in torch costs about eight small ops per hooked linear (a gather, two
batched matmuls, an index_add and casts), each a call of tens of microseconds at decode batch
sizes; the kernel does the gather, the shrink (float32 sums), the expand on each segment's own
output rows and rank columns, and the add into y in one pass over the step's adapter rows,
in tiles of one slot's rows on the step's threads. Layouts (per slot s):
  a [S, ceil(in/2), Wp, 2]: A [W, in] transposed with input pairs interleaved (`pack_a`);
  b [S, Wp/2, out, 2]: scaled B [out, W] transposed, rank pairs interleaved (`pack_b`);
  Wp = W rounded up to 16;
  segs int32 [S, NSEG, 4]: (lo, hi, c0, c1), output rows [lo, hi) take rank columns [c0, c1).
"""
from __future__ import annotations

from types import ModuleType

import torch

from kernels.cpu_build import load_cpu_extension

LANES = 16  # Wp is a multiple of this


def load() -> ModuleType | None:
    """The compiled module (lora_apply_, bf16_path), or None if it cannot be built here."""
    return load_cpu_extension("lora_apply", "lora_apply.cpp")


def padded_width(width: int) -> int:
    """The kernel's rank-column count for `width` columns: a multiple of LANES."""
    return -(-width // LANES) * LANES


def pack_a(a: torch.Tensor, wp: int) -> torch.Tensor:
    """A [W, in] → [ceil(in/2), wp, 2] (zero columns past W; an odd in's last pair ends in 0)."""
    w, n_in = a.shape
    at = a.new_zeros(wp, n_in + n_in % 2)
    at[:w, :n_in] = a
    return at.view(wp, -1, 2).transpose(0, 1).contiguous()


def pack_b(b: torch.Tensor, wp: int) -> torch.Tensor:
    """scaled B [out, W] → [wp/2, out, 2] (rank pairs interleaved; zero columns past W)."""
    bt = b.new_zeros(wp, b.shape[0])
    bt[:b.shape[1]] = b.t()
    return bt.view(wp // 2, 2, -1).transpose(1, 2).contiguous()


def unpack_b(packed: torch.Tensor) -> torch.Tensor:
    """[Wp/2, out, 2] → B transposed [Wp, out] (pack_b's inverse)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])


def unpack_a(packed: torch.Tensor, n_in: int) -> torch.Tensor:
    """[ceil(in/2), Wp, 2] → A [Wp, in] (pack_a's inverse, padding columns included)."""
    return packed.transpose(0, 1).reshape(packed.shape[1], -1)[:, :n_in]


def lora_apply_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: torch.Tensor,
                order: torch.Tensor, groups: torch.Tensor, module: ModuleType | None = None) -> None:
    """y[order[i]] += sum over the slot's segments of B[lo:hi, c0:c1] A[c0:c1] x[order[i]], in place.
    x [T, in], y [T, out] one dtype; order int32 [n] distinct rows grouped by slot; groups int32 [G, 3]
    (slot, begin, end) into order. Rows not in order are untouched."""
    module = module or load()
    if module is None:
        raise RuntimeError("the CPU LoRA kernel is not built")
    module.lora_apply_(x, y, a, b, segs, order, groups)


def lora_apply_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: torch.Tensor,
                         order: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The same contract in float32 torch → y's new value as float32 (y itself is not changed)."""
    out = y.float().clone()
    for slot, begin, end in groups.tolist():
        rows = order[begin:end].long()
        xs = x[rows].float()  # [n, in]
        a_s, b_s = unpack_a(a[slot], x.shape[1]).float(), unpack_b(b[slot]).float()  # [Wp, in], [Wp, out]
        for lo, hi, c0, c1 in segs[slot].tolist():
            if hi > lo and c1 > c0:
                out[rows, lo:hi] += (xs @ a_s[c0:c1].t()) @ b_s[c0:c1, lo:hi]
    return out
