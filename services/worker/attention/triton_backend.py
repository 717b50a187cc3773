"""The "triton" attention backend: the step's decode items through the paged decode kernel
(kernels/triton/decode_attention.py), its extend items (prefill chunks, verify items) through
the extend kernel (kernels/triton/extend_attention.py), on the pool's device: CUDA, or CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run it.

prepare builds the step's index tensors once, on the pool's device (each group's rows of q,
page-table rows, KV lengths, cu_q, start positions) and picks the decode split count from the
layout's host ints, so no layer's forward copies from the host or syncs. forward writes the
layer's K/V (KVPool.write) and runs at most two kernels; a step of one kind runs one, reading q
and writing the output with no gather.

FP8 pools: the kernels widen rows times the format's scale; this backend rotates q before and
the output after (kernels/kv_fp8.hadamard_rotate, float32), as the torch backend does.
No tuning of its own (attach) and no one-call steps: every step runs op by op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.kv_fp8 import hadamard_block, hadamard_rotate
from kernels.triton.decode_attention import choose_num_splits, decode_attention
from kernels.triton.extend_attention import extend_attention
from kernels.triton.mla_decode import mla_decode_attention, mla_extend_attention
from services.worker.attention.backend import Attached, DecodeStep
from services.worker.attention.batch_layout import BatchLayout
from services.worker.host_to_device import to_device
from services.worker.kv_pool import KVPool
from services.worker.model.layer_attention import LayerAttention


@dataclass(frozen=True)
class _DecodeGroup:
    """The step's items with one query token, for the decode kernel."""

    rows: torch.Tensor | None  # [b] int64 their tokens' rows of q; None: every row, in order
    page_table: torch.Tensor  # [b, P] int64
    kv_lens: torch.Tensor  # [b] int64
    max_kv_len: int
    num_splits: int


@dataclass(frozen=True)
class _ExtendGroup:
    """The step's items with several query tokens, for the extend kernel."""

    rows: torch.Tensor | None  # [t] int64 their tokens' rows of q, item by item; None: every row
    page_table: torch.Tensor  # [e, P] int64
    cu_q: torch.Tensor  # [e + 1] int64, offsets into the gathered t rows
    start_pos: torch.Tensor  # [e] int64
    max_q_len: int


class TritonAttentionBackend:
    """sliding_window W: a query at position p attends to keys p - W + 1 .. p only (Mistral);
    a layer's LayerAttention (Gemma 2) replaces the backend's scale and window for that layer."""

    def __init__(self, scale: float, sliding_window: int | None = None):
        self.default = LayerAttention(scale, sliding_window)  # the layers that pass no variant of their own
        self.pool: KVPool | None = None
        self.out_slots: torch.Tensor | None = None  # [T] int64 on the pool's device
        self.decode: _DecodeGroup | None = None
        self.extend: _ExtendGroup | None = None

    def attach(self, model, config, checkpoint, prepacked: bool) -> Attached:
        return Attached()  # no tuning of its own

    def one_call_step(self, step: DecodeStep, before_compute: Callable[[], None]) -> torch.Tensor | None:
        return None  # every step op by op

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        """The step's index tensors, on the pool's device, for every layer's forward: derived on
        the host from the layout's host original, then moved in one copy (host_to_device.py)."""
        device = pool.k.device
        self.pool = pool
        self.out_slots = layout.out_slots.to(device)  # the runner's layout is there already
        table = layout.page_rows.to(device)  # [B, P]
        host = layout.host or layout  # no copy back from the device
        q_lens = host.q_lens.cpu()
        is_decode = q_lens == 1
        decode_items = is_decode.nonzero().flatten()  # [b]
        extend_items = (~is_decode).nonzero().flatten()  # [e]
        both = bool(len(decode_items)) and bool(len(extend_items))
        first = torch.cumsum(q_lens, 0) - q_lens  # [B] each item's first row
        kv_lens = host.kv_lens.cpu()[decode_items]  # [b]
        lens = q_lens[extend_items]  # [e]
        cu_q = torch.zeros(len(extend_items) + 1, dtype=torch.int64)
        cu_q[1:] = torch.cumsum(lens, 0)
        extend_rows = (~is_decode)[host.token_item.cpu()].nonzero().flatten()  # [t]: items stay in order
        d_rows, d_items, d_lens, e_rows, e_items, e_cu_q, e_start = to_device(
            [first[decode_items], decode_items, kv_lens, extend_rows, extend_items, cu_q,
             host.start_pos.cpu()[extend_items]], device)
        self.decode = self.extend = None
        if len(decode_items):
            max_kv = int(kv_lens.max())
            self.decode = _DecodeGroup(d_rows if both else None, table[d_items] if both else table, d_lens, max_kv,
                                       choose_num_splits(len(decode_items), pool.spec.num_kv_heads, max_kv, device))
        if len(extend_items):
            self.extend = _ExtendGroup(e_rows if both else None, table[e_items] if both else table, e_cu_q, e_start,
                                       int(lens.max()))

    def prepare_graph_decode(self, layout: BatchLayout, pool: KVPool) -> None:
        """prepare for a CUDA graph's decode step (services/worker/cuda_graphs.py): every row one
        query token, layout's tensors the graph's static device buffers, read as they are (no
        host copy, no sync), and the split count fixed by layout.max_kv_len (the longest
        context the page table holds), so one captured launch serves every replay."""
        self.pool, self.out_slots, self.extend = pool, layout.out_slots, None
        batch = layout.kv_lens.shape[0]
        self.decode = _DecodeGroup(None, layout.page_rows, layout.kv_lens, layout.max_kv_len,
                                   choose_num_splits(batch, pool.spec.num_kv_heads, layout.max_kv_len, pool.k.device))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        """q [T, H, D]; k, v [T, Hkv, D] → [T, H, D] in q's dtype (this step's K/V written first)."""
        spec = variant or self.default
        pool = self.pool
        pool.write(layer, self.out_slots, k, v)
        if pool.spec.is_latent:
            return self._latent(layer, q, spec)
        fp8 = pool.spec.is_fp8
        qr = hadamard_rotate(q.float()).to(q.dtype) if fp8 else q  # the pool's rotated space
        kl, vl, page_size = pool.k[layer], pool.v[layer], pool.spec.page_size
        options = dict(window=spec.window, softcap=spec.softcap)
        out = None
        if self.decode is not None:
            d = self.decode
            qd = qr if d.rows is None else qr.index_select(0, d.rows)
            od = decode_attention(qd, kl, vl, d.page_table, d.kv_lens, page_size, spec.scale,
                                  num_splits=d.num_splits, max_kv_len=d.max_kv_len, **options)
            out = od if d.rows is None else torch.empty_like(q).index_copy_(0, d.rows, od)
        if self.extend is not None:
            e = self.extend
            qe = qr if e.rows is None else qr.index_select(0, e.rows)
            oe = extend_attention(qe, kl, vl, e.page_table, e.cu_q, e.start_pos, page_size, spec.scale,
                                  max_q_len=e.max_q_len, **options)
            out = oe if e.rows is None else out.index_copy_(0, e.rows, oe)
        return hadamard_rotate(out.float()).to(q.dtype) if fp8 else out

    def _latent(self, layer: int, q: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
        """An MLA latent pool (one row a token, V its first latent_dim columns): the step's decode
        and extend items through kernels/triton/mla_decode.py. q [T, H, D] → [T, H, latent_dim];
        an FP8 pool's query and output rotate in the blocks of its rows."""
        pool, v_dim = self.pool, self.pool.spec.latent_dim
        block = hadamard_block(pool.spec.head_dim)
        fp8 = pool.spec.is_fp8
        qr = hadamard_rotate(q.float(), block).to(q.dtype) if fp8 else q
        kv, page_size = pool.k[layer], pool.spec.page_size
        out = q.new_empty((*q.shape[:-1], v_dim))
        if self.decode is not None:
            d = self.decode
            qd = qr if d.rows is None else qr.index_select(0, d.rows)
            od = mla_decode_attention(qd, kv, d.page_table, d.kv_lens, page_size, spec.scale, v_dim,
                                      num_splits=d.num_splits, max_kv_len=d.max_kv_len)
            out = od if d.rows is None else out.index_copy_(0, d.rows, od)
        if self.extend is not None:
            e = self.extend
            qe = qr if e.rows is None else qr.index_select(0, e.rows)
            oe = mla_extend_attention(qe, kv, e.page_table, e.cu_q, e.start_pos, page_size, spec.scale, v_dim,
                                      max_q_len=e.max_q_len)
            out = oe if e.rows is None else out.index_copy_(0, e.rows, oe)
        return hadamard_rotate(out.float(), block).to(q.dtype) if fp8 else out
