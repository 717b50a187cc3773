"""Reference attention over the paged KV pool, in plain torch.

Items are split into two groups, each run as one padded SDPA call: decode
items (one query token) and extend items (prefill chunks). Padding a decode
item to a prefill chunk's length would waste most of the work of a mixed step.
There is no loop over requests: gathers through slot matrices do the paging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.attention.batch_layout import BatchLayout, slots_of
from services.worker.kv_pool import KVPool


@dataclass
class _Group:
    q_index: torch.Tensor  # [b, Lq] token indices into the step's T tokens (padding repeats a valid one)
    q_valid: torch.Tensor  # [b, Lq] bool
    kv_slots: torch.Tensor  # [b, Lk] KV slots (padding clamped to a valid slot)
    kv_lens: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, 1, Lq, Lk] bool, True = attend


class TorchAttentionBackend:
    """native_decode: run pure-decode steps through the C++ paged kernel
    (kernels/paged_decode_cpu.py), which reads KV in place instead of gathering it.
    sliding_window W: a query at position p attends to keys p - W + 1 .. p only (Mistral);
    the native kernel has no window, so it is declined then (gather + SDPA with the mask)."""

    def __init__(self, scale: float, native_decode: bool = False, sliding_window: int | None = None):
        self.scale = scale
        self.sliding_window = sliding_window
        self.native = None
        if native_decode and sliding_window is None:
            from kernels import paged_decode_cpu
            self.native = paged_decode_cpu.load()  # None when it cannot be built: gather + SDPA
        self.pool: KVPool | None = None
        self.layout: BatchLayout | None = None
        self.groups: list[_Group] = []
        self._kbuf: torch.Tensor | None = None  # gather buffers, grown on demand
        self._vbuf: torch.Tensor | None = None

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        self.pool, self.layout = pool, layout
        is_decode = layout.q_lens == 1
        self.groups = [
            _build_group(layout, sel.nonzero().flatten(), self.sliding_window)
            for sel in (is_decode, ~is_decode) if bool(sel.any())
        ]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]
        pool = self.pool
        pure_decode = len(self.groups) == 1 and self.groups[0].q_index.shape[1] == 1  # rows already in order
        if pure_decode and self.native is not None:  # the kernel writes this step's K/V itself
            return self._decode(layer, q, self.groups[0], (k, v, self.layout.out_slots))
        pool.write(layer, self.layout.out_slots, k, v)
        if pure_decode:
            return self._decode(layer, q, self.groups[0])
        out = torch.empty_like(q)
        for group in self.groups:  # at most two: decode, extend
            if group.q_index.shape[1] == 1:
                rows = group.q_index[:, 0]
                out[rows] = self._decode(layer, q.index_select(0, rows), group)
            else:
                o = self._attend(layer, q, group)  # [b, Lq, H, D]
                out[group.q_index[group.q_valid]] = o[group.q_valid]
        return out

    def _gather(self, layer: int, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """This group's K and V, [b, Hkv, Lk, D], copied into reused buffers: a fresh
        multi-MB tensor per layer costs page faults on every step."""
        b, lk = g.kv_slots.shape
        n = b * lk
        if self._kbuf is None or self._kbuf.shape[0] < n or self._kbuf.dtype != self.pool.k.dtype:
            self._kbuf = self.pool.k.new_empty((n, *self.pool.k.shape[2:]))
            self._vbuf = self.pool.v.new_empty((n, *self.pool.v.shape[2:]))
        flat = g.kv_slots.flatten()
        # index_select copies whole [Hkv, D] rows; advanced indexing is ~10x slower here.
        kg = torch.index_select(self.pool.k[layer], 0, flat, out=self._kbuf[:n])
        vg = torch.index_select(self.pool.v[layer], 0, flat, out=self._vbuf[:n])
        return kg.view(b, lk, *kg.shape[1:]).transpose(1, 2), vg.view(b, lk, *vg.shape[1:]).transpose(1, 2)

    def _decode(self, layer: int, q: torch.Tensor, g: _Group,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One query token per item: the G query heads sharing a KV head act as a
        query length of G, so SDPA needs no GQA expansion. q [B, H, D] → [B, H, D].
        new_kv (k [B, Hkv, D], v, slots [B]): rows the native kernel writes first."""
        if self.native is not None:
            kv_dtype = self.pool.k.dtype
            extra = () if new_kv is None else (new_kv[0].to(kv_dtype), new_kv[1].to(kv_dtype), new_kv[2])
            return self.native.paged_decode_attention(
                q, self.pool.k[layer], self.pool.v[layer], g.kv_slots, g.kv_lens, self.scale, *extra)
        kg, vg = self._gather(layer, g)  # [B, Hkv, Lk, D]
        B, hkv = kg.shape[:2]
        qg = q.view(B, hkv, -1, q.shape[-1]).to(kg.dtype)  # [B, Hkv, G, D]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale)
        return o.reshape(q.shape).to(q.dtype)

    def _attend(self, layer: int, q: torch.Tensor, g: _Group) -> torch.Tensor:
        b, lq = g.q_index.shape
        qg = q.index_select(0, g.q_index.flatten()).view(b, lq, *q.shape[1:]).transpose(1, 2)  # [b, H, Lq, D]
        kg, vg = self._gather(layer, g)
        o = F.scaled_dot_product_attention(
            qg.to(kg.dtype), kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).to(q.dtype)  # [b, Lq, H, D]


def _build_group(layout: BatchLayout, items: torch.Tensor, window: int | None = None) -> _Group:
    q_lens, start, kv_lens = layout.q_lens[items], layout.start_pos[items], layout.kv_lens[items]
    max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
    first_token = (torch.cumsum(layout.q_lens, 0) - layout.q_lens)[items]
    qi = torch.arange(max_q)
    q_valid = qi[None, :] < q_lens[:, None]  # [b, Lq]
    q_index = first_token[:, None] + torch.minimum(qi[None, :], q_lens[:, None] - 1)
    kj = torch.arange(max_kv)
    k_pos = torch.minimum(kj[None, :], kv_lens[:, None] - 1)  # [b, Lk]
    kv_slots = slots_of(layout.page_rows, items[:, None], k_pos, layout.page_size)
    q_abs = start[:, None] + qi[None, :]  # [b, Lq] absolute position of each query
    mask = (kj[None, None, :] <= q_abs[:, :, None]) & (kj[None, None, :] < kv_lens[:, None, None])
    if window is not None:  # keys older than the window; padded queries keep their last valid one's
        q_last = start[:, None] + torch.minimum(qi[None, :], q_lens[:, None] - 1)  # [b, Lq]
        mask &= kj[None, None, :] > q_last[:, :, None] - window
    return _Group(q_index, q_valid, kv_slots, kv_lens, mask.unsqueeze(1))
