"""Reference attention over the paged KV pool, in plain torch.

Items are split into two groups, each run as one padded SDPA call: decode
items (one query token) and extend items (prefill chunks). Padding a decode
item to a prefill chunk's length would waste most of the work of a mixed step.
There is no loop over requests: gathers through slot matrices do the paging.
An FP8 pool (--kv-cache-dtype) is gathered as bytes and widened to the query's dtype
(times its scale, kernels/kv_fp8.py) before SDPA. Its rows are stored Hadamard-rotated, so
the query is rotated before and the output after (q.k = Hq.Hk; sum p Hv = H sum p v);
the native decode kernel does the same in place.
A draft tree's verify item (BatchLayout.trees) is an extend item whose mask among its own tokens
is the tree's ancestor mask instead of the causal triangle, and whose window counts RoPE positions
(start + depth) rather than slot positions; a tree of one token is a plain decode item.
An MLA latent pool (KVPoolSpec.latent_dim) is one KV head whose V is the first latent_dim
columns of K: the layer's q is [T, H, D] in the latent space (absorbed), the output
[T, H, latent_dim]; the pool's FP8 rotation blocks are those of K's row, for V's columns too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from services.worker.attention.backend import Attached, DecodeStep
from services.worker.attention.batch_layout import BatchLayout, slots_of
from kernels.kv_fp8 import hadamard_block, hadamard_rotate, widen_kv
from services.worker.kv_pool import KVPool
from services.worker.model.layer_attention import LayerAttention


@dataclass
class _Group:
    q_index: torch.Tensor  # [b, Lq] token indices into the step's T tokens (padding repeats a valid one)
    q_valid: torch.Tensor  # [b, Lq] bool
    kv_slots: torch.Tensor  # [b, Lk] KV slots (padding clamped to a valid slot)
    kv_lens: torch.Tensor  # [b]
    causal: torch.Tensor  # [b, 1, Lq, Lk] bool, True = attend
    q_last: torch.Tensor  # [b, Lq] position of each query (padding: its item's last valid one)
    masks: dict = field(default_factory=dict)  # window → mask, built on a layer's first use of it
    # [b, Lk] RoPE position of each key where a tree item's differs from its slot position; None: none does
    k_pos: torch.Tensor | None = None

    def mask(self, window: int | None) -> torch.Tensor:
        """[b, 1, Lq, Lk] bool: causal (a tree item: its ancestors), and keys older than `window`
        dropped when one is given."""
        if window not in self.masks:
            kj = torch.arange(self.causal.shape[-1]) if self.k_pos is None else self.k_pos[:, None, None, :]
            self.masks[window] = self.causal if window is None else (
                self.causal & (kj > self.q_last[:, None, :, None] - window))
        return self.masks[window]


class TorchAttentionBackend:
    """native_decode: run pure-decode steps through the C++ paged kernel
    (kernels/paged_decode_cpu.py), which reads KV in place instead of gathering it.
    sliding_window W: a query at position p attends to keys p - W + 1 .. p only (Mistral);
    the native kernel has no window and no soft-cap, so it is declined for a backend with a window
    and for a layer whose LayerAttention has either (gather + SDPA with the mask, or the
    soft-capped attention of Gemma 2 in plain torch)."""

    def __init__(self, scale: float, native_decode: bool = False, sliding_window: int | None = None):
        self.default = LayerAttention(scale, sliding_window)  # the layers that pass no variant of their own
        self.native = self.native_mla = None
        if native_decode and sliding_window is None:
            from kernels import mla_decode_cpu, paged_decode_cpu
            self.native = paged_decode_cpu.load()  # None when it cannot be built: gather + SDPA
            self.native_mla = mla_decode_cpu.load()  # a latent pool's decode (MLA), likewise
        self.pool: KVPool | None = None
        self.layout: BatchLayout | None = None
        self.groups: list[_Group] = []
        self._kbuf: torch.Tensor | None = None  # gather buffers, grown on demand
        self._vbuf: torch.Tensor | None = None

    def attach(self, model, config, checkpoint, prepacked: bool) -> Attached:
        return Attached()  # no tuning of its own: the plain reference

    def one_call_step(self, step: DecodeStep, before_compute: Callable[[], None]) -> torch.Tensor | None:
        return None  # every step op by op

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        self.pool, self.layout = pool, layout
        is_decode = layout.q_lens == 1
        self.groups = [
            _build_group(layout, sel.nonzero().flatten())
            for sel in (is_decode, ~is_decode) if bool(sel.any())
        ]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]
        spec = variant or self.default
        pool = self.pool
        native = self.native if spec.window is None and spec.softcap is None and not pool.spec.is_latent else None
        pure_decode = len(self.groups) == 1 and self.groups[0].q_index.shape[1] == 1  # rows already in order
        if pure_decode and native is not None:  # the kernel writes this step's K/V itself
            return self._decode(layer, q, self.groups[0], spec, native, (k, v, self.layout.out_slots))
        pool.write(layer, self.layout.out_slots, k, v)
        if pure_decode and self.native_mla is not None and pool.spec.is_latent and spec.softcap is None \
                and spec.window is None:
            return self._latent_decode(layer, q, self.groups[0], spec)
        if pure_decode:
            return self._decode(layer, q, self.groups[0], spec, native)
        out = q.new_empty((*q.shape[:-1], self._v_dim()))  # [T, H, Dv]
        for group in self.groups:  # at most two: decode, extend
            if group.q_index.shape[1] == 1:
                rows = group.q_index[:, 0]
                out[rows] = self._decode(layer, q.index_select(0, rows), group, spec, native)
            else:
                o = self._attend(layer, q, group, spec)  # [b, Lq, H, D]
                out[group.q_index[group.q_valid]] = o[group.q_valid]
        return out

    def _gather(self, layer: int, g: _Group, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This group's K and V, [b, Hkv, Lk, D], copied into reused buffers: a fresh
        multi-MB tensor per layer costs page faults on every step. An FP8 pool's rows come
        back widened to `dtype` (the query's) and still rotated (_rotated_query); any other
        pool's in its own dtype."""
        b, lk = g.kv_slots.shape
        n = b * lk
        if self._kbuf is None or self._kbuf.shape[0] < n or self._kbuf.dtype != self.pool.k.dtype:
            self._kbuf = self.pool.k.new_empty((n, *self.pool.k.shape[2:]))
            self._vbuf = self.pool.v.new_empty((n, *self.pool.v.shape[2:]))
        flat = g.kv_slots.flatten()
        # index_select copies whole [Hkv, D] rows; advanced indexing is ~10x slower here.
        kg = torch.index_select(self.pool.k[layer], 0, flat, out=self._kbuf[:n])
        if self.pool.spec.is_latent:  # V: K's first latent_dim columns, not copied
            vg = kg[..., :self.pool.spec.latent_dim]
        else:
            vg = torch.index_select(self.pool.v[layer], 0, flat, out=self._vbuf[:n])
        if self.pool.spec.is_fp8:
            kg, vg = widen_kv(kg, dtype), widen_kv(vg, dtype)
        return kg.view(b, lk, *kg.shape[1:]).transpose(1, 2), vg.view(b, lk, *vg.shape[1:]).transpose(1, 2)

    def _decode(self, layer: int, q: torch.Tensor, g: _Group, spec: LayerAttention, native,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One query token per item: the G query heads sharing a KV head act as a
        query length of G, so SDPA needs no GQA expansion. q [B, H, D] → [B, H, D].
        native: the paged kernel, or None. new_kv (k [B, Hkv, D], v, slots [B]): rows it writes first."""
        if native is not None:  # new rows in the model's dtype: the kernel rounds them (FP8: rotated too)
            extra = () if new_kv is None else new_kv
            return native.paged_decode_attention(
                q, self.pool.k[layer], self.pool.v[layer], g.kv_slots, g.kv_lens, spec.scale, *extra)
        kg, vg = self._gather(layer, g, q.dtype)  # [B, Hkv, Lk, D]
        B, hkv = kg.shape[:2]
        qg = self._rotated(q).view(B, hkv, -1, q.shape[-1]).to(kg.dtype)  # [B, Hkv, G, D]
        o = _scores_softmax_v(qg, kg, vg, g.mask(spec.window), spec)  # mask [B, 1, 1, Lk]
        return self._rotated(o).reshape(*q.shape[:-1], self._v_dim()).to(q.dtype)

    def _latent_decode(self, layer: int, q: torch.Tensor, g: _Group, spec: LayerAttention) -> torch.Tensor:
        """A pure-decode step over a latent pool through the C++ kernel (kernels/mla_decode_cpu.py):
        every head reads each cached row in place. q [B, H, D] → [B, H, latent_dim]; an FP8 pool's
        query and output rotate in the blocks of its rows (the kernel reads rows as scaled values)."""
        fp8 = self.pool.spec.is_fp8
        qk = self._rotated(q) if fp8 else q
        out = self.native_mla.mla_decode_attention(qk.contiguous(), self.pool.k[layer], g.kv_slots, g.kv_lens,
                                                   spec.scale, self.pool.spec.latent_dim)
        return (self._rotated(out) if fp8 else out).to(q.dtype)

    def _v_dim(self) -> int:
        """The width of a V row: the pool's, or a latent pool's latent_dim."""
        spec = self.pool.spec
        return spec.latent_dim if spec.is_latent else spec.head_dim

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] in the FP8 pool's rotated space (or back: H is its own inverse), float32;
        x itself for any other pool. The C++ kernel's rows op when built (the same butterflies).
        A latent pool's query and output rotate in the blocks of its K rows."""
        spec = self.pool.spec
        if not spec.is_fp8:
            return x
        if spec.is_latent:
            return hadamard_rotate(x.float(), hadamard_block(spec.head_dim))
        if self.native is None:
            return hadamard_rotate(x.float())
        return self.native.hadamard_rows(x.to(torch.float32, copy=True).contiguous())

    def _attend(self, layer: int, q: torch.Tensor, g: _Group, spec: LayerAttention) -> torch.Tensor:
        b, lq = g.q_index.shape
        qg = q.index_select(0, g.q_index.flatten()).view(b, lq, *q.shape[1:]).transpose(1, 2)  # [b, H, Lq, D]
        kg, vg = self._gather(layer, g, q.dtype)  # [b, Hkv, Lk, D]
        mask = g.mask(spec.window)  # [b, 1, Lq, Lk]
        qg = self._rotated(qg).to(kg.dtype)
        if spec.softcap is None:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=spec.scale, enable_gqa=True)
        else:  # the G query heads of a KV head as one more dimension: [b, Hkv, G, Lq, D]
            hkv = kg.shape[1]
            q5 = qg.view(b, hkv, -1, lq, qg.shape[-1])
            o = _scores_softmax_v(q5, kg.unsqueeze(2), vg.unsqueeze(2), mask.unsqueeze(2), spec).flatten(1, 2)
        return self._rotated(o.transpose(1, 2)).to(q.dtype)  # [b, Lq, H, D]


def _scores_softmax_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      spec: LayerAttention) -> torch.Tensor:
    """softmax(q k^T * scale, soft-capped when spec says, masked) v. q [..., M, D]; k, v [..., Lk, D];
    mask bool, broadcastable to [..., M, Lk] → [..., M, D]."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale  # [..., M, Lk]
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _build_group(layout: BatchLayout, items: torch.Tensor) -> _Group:
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
    causal = (kj[None, None, :] <= q_abs[:, :, None]) & (kj[None, None, :] < kv_lens[:, None, None])
    q_last = start[:, None] + torch.minimum(qi[None, :], q_lens[:, None] - 1)  # [b, Lq]
    group = _Group(q_index, q_valid, kv_slots, kv_lens, causal.unsqueeze(1), q_last)
    if layout.trees:
        _apply_trees(group, layout, items)
    return group


def _apply_trees(g: _Group, layout: BatchLayout, items: torch.Tensor) -> None:
    """Rewrites the rows of the group's tree items: among its own tokens a query sees its
    ancestors and itself (not the causal triangle), and its window counts RoPE positions."""
    trees = {r: layout.trees[i] for r, i in enumerate(items.tolist()) if i in layout.trees}
    trees = {r: t for r, t in trees.items() if t.n}  # one token: the causal row already
    if not trees:
        return
    dev = g.causal.device
    g.k_pos = torch.arange(g.causal.shape[-1], device=dev).repeat(len(items), 1)  # [b, Lk]
    for r, tree in trees.items():
        start, n1 = int(layout.start_pos[items[r]]), tree.n + 1
        depth = start + torch.tensor(tree.depths(), dtype=torch.int64, device=dev)  # [n + 1]
        g.causal[r, 0, :n1, start:start + n1] = tree.ancestor_mask().to(dev)
        g.q_last[r, :n1], g.q_last[r, n1:] = depth, depth[-1]
        g.k_pos[r, start:start + n1] = depth
