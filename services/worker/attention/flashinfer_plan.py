"""A step's BatchLayout in FlashInfer's paged-KV terms: pure torch, any device, no FlashInfer.

FlashInfer's paged wrappers see a batch as CSR arrays. Request i's KV is the pages
indices[indptr[i]:indptr[i+1]], all full except the last, which holds last_page_len[i] entries
(1..page_size); for prefill its queries are rows qo_indptr[i]:qo_indptr[i+1] of q, aligned to the
end of its KV (query j sees KV positions <= kv_len - q_len + j: our start_pos + j). Our pool's
slot = page * page_size + offset is exactly that paged layout ("NHD"), so the page ids are the
layout's page-table rows unchanged.

A step is split by item kind, as the torch backend splits it: decode items (one query token) go
to the decode wrapper, every other item (a prefill chunk over a cached prefix, a verify item) to
the causal prefill wrapper. Each group's queries are its items' tokens in step order, so each
group is a sorted subset of the step's tokens (`q_index`) and its output rows scatter back there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.batch_layout import BatchLayout


@dataclass(frozen=True)
class PagedPlan:
    """One wrapper's share of a step (b items, n query tokens). The int32 CSR arrays are what
    FlashInfer's plan() takes; the int64 ones are ours, for gathering q and scattering o."""

    items: torch.Tensor  # [b] int64: the layout's items in this group, ascending
    q_index: torch.Tensor  # [n] int64: this group's tokens in the step's order (ascending)
    qo_indptr: torch.Tensor  # [b + 1] int32: item i's queries are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [b + 1] int32: item i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32: page ids
    last_page_len: torch.Tensor  # [b] int32 in 1..page_size: entries used in each item's last page
    whole_step: bool  # the group is every token of the step, in order: q needs no gather

    @property
    def batch_size(self) -> int:
        return self.items.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.q_index.shape[0]


def split_items(q_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lens [B] → (decode items, extend items), each an ascending int64 index tensor (either
    may be empty): decode items have one query token."""
    is_decode = q_lens == 1
    return is_decode.nonzero().flatten(), (~is_decode).nonzero().flatten()


def paged_plan(q_lens: torch.Tensor, kv_lens: torch.Tensor, page_rows: torch.Tensor, page_size: int,
               items: torch.Tensor) -> PagedPlan:
    """The plan of `items` (ascending indices into the step's B items).

    q_lens, kv_lens [B] int64; page_rows [B, P] int64, row i holding item i's pages (padded past
    ceil(kv_lens[i] / page_size)). All on one device; the result is on it too. ValueError when an
    item has no query token, less KV than queries, or more pages than its row holds."""
    if items.numel() == 0:
        raise ValueError("a plan needs at least one item")
    ql, kv = q_lens[items], kv_lens[items]
    num_pages = (kv + page_size - 1) // page_size  # [b]
    if bool((ql < 1).any()) or bool((kv < ql).any()):
        raise ValueError(f"every item needs 1 <= q_len <= kv_len, got q_lens {ql.tolist()}, kv_lens {kv.tolist()}")
    if int(num_pages.max()) > page_rows.shape[1]:
        raise ValueError(f"an item needs {int(num_pages.max())} pages, its page-table row holds {page_rows.shape[1]}")
    # The used pages of each row, row after row: a boolean mask reads them in CSR order.
    used = torch.arange(page_rows.shape[1], device=page_rows.device)[None, :] < num_pages[:, None]  # [b, P]
    kv_indices = page_rows[items][used]
    last_page_len = kv - (num_pages - 1) * page_size
    # The group's tokens: each item's first token index in the step, plus 0 .. q_len - 1.
    first = (torch.cumsum(q_lens, 0) - q_lens)[items]  # [b]
    n = int(ql.sum())
    item_of = torch.repeat_interleave(torch.arange(items.numel(), device=items.device), ql, output_size=n)
    start_in_group = torch.cumsum(ql, 0) - ql  # [b]
    q_index = first[item_of] + torch.arange(n, device=items.device) - start_in_group[item_of]
    return PagedPlan(
        items=items,
        q_index=q_index,
        qo_indptr=_indptr(ql),
        kv_indptr=_indptr(num_pages),
        kv_indices=kv_indices.to(torch.int32),
        last_page_len=last_page_len.to(torch.int32),
        whole_step=items.numel() == q_lens.numel(),
    )


def step_plans(layout: BatchLayout) -> dict[str, PagedPlan]:
    """The layout's plans by wrapper: "decode" and "extend", each only when it has items. Runs
    on the layout's device (its q_lens and page_rows: host tensors plan without a sync)."""
    decode, extend = split_items(layout.q_lens)
    plans = {}
    for kind, items in (("decode", decode), ("extend", extend)):
        if items.numel():
            plans[kind] = paged_plan(layout.q_lens, layout.kv_lens, layout.page_rows, layout.page_size, items)
    return plans


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    """counts [b] → [b + 1] int32 running sums from 0."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = torch.cumsum(counts, 0)
    return out
