"""What a sender and a receiver must agree on, and the page runs a send moves.

A pool's k and v are each [L, S, Hkv, D] with page p at slots [p*P, (p+1)*P), so within one
layer a run of consecutive pages is one contiguous byte range: a send is a list of runs,
each moved once per layer and tensor. An MLA latent pool (KVPoolSpec.latent_dim > 0) holds its
bytes in k [L, S, 1, D] alone (its v is zero-width): it moves one tensor, never a V.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.worker.kv_pool import KVPool
from services.worker.kv_transfer.engine import KVTransferError


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # the storage dtype's name: "bfloat16", "float8_e4m3fn", ...
    num_pages: int  # pages the tensors hold, extra pages included
    latent_dim: int = 0  # > 0: an MLA latent pool, k alone (V = K[..., :latent_dim])

    @classmethod
    def of(cls, pool: KVPool) -> PoolLayout:
        L, S, h, d = pool.k.shape
        spec = pool.spec
        return cls(L, h, d, spec.page_size, str(pool.k.dtype).removeprefix("torch."), S // spec.page_size,
                   spec.latent_dim)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The pool's tensors that hold bytes, in KVPool.tensors' order: ("k", "v"), or ("k",) if latent."""
        return ("k",) if self.latent_dim else ("k", "v")

    @property
    def page_bytes(self) -> int:
        """One page of one layer of k (or v)."""
        return self.page_size * self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize

    @property
    def layer_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def tensor_bytes(self) -> int:
        """All of k (or v)."""
        return self.num_layers * self.layer_bytes

    def send_bytes(self, pages: int) -> int:
        """What a send of `pages` pages moves: every layer of every tensor (k alone if latent)."""
        return pages * len(self.tensor_names) * self.num_layers * self.page_bytes

    def same_format(self, other: PoolLayout) -> bool:
        """Pages of one fit the other's (the page counts may differ)."""
        return dataclasses.replace(self, num_pages=0) == dataclasses.replace(other, num_pages=0)

    def describe(self) -> str:
        latent = f" (latent {self.latent_dim}, k only)" if self.latent_dim else ""
        return (f"{self.num_layers} layers x {self.num_kv_heads} kv heads x head_dim {self.head_dim}{latent}, "
                f"page_size {self.page_size}, {self.dtype}, {self.num_pages} pages")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class PageRun(NamedTuple):
    src: int  # first source page
    dst: int  # first destination page
    count: int


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[PageRun]:
    """Consecutive (src, dst) pairs that both advance by one, merged: [(3,10),(4,11),(9,2)] ->
    [PageRun(3, 10, 2), PageRun(9, 2, 1)]."""
    runs: list[PageRun] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and s == runs[-1].src + runs[-1].count and d == runs[-1].dst + runs[-1].count:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(PageRun(s, d, 1))
    return runs


def make_descriptor(backend: str, peer: str, layout: PoolLayout, **fields) -> str:
    """A decode engine's descriptor: JSON with the backend, a peer name for messages, the
    pool's layout and the backend's own fields."""
    return json.dumps({"backend": backend, "peer": peer, "layout": layout.to_dict(), **fields})


def plan_send(descriptor: str, backend: str, local: PoolLayout, src_pages: list[int],
              dst_pages: list[int]) -> tuple[dict, list[PageRun]]:
    """Parse and check a receiver's descriptor against this pool and the page lists; returns
    (the descriptor's fields, the runs to move). KVTransferError names the peer and the fault."""
    try:
        desc = json.loads(descriptor)
        peer, remote = desc["peer"], PoolLayout(**desc["layout"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"not a KV transfer descriptor ({e}): {descriptor[:200]!r}") from None
    if desc.get("backend") != backend:
        raise KVTransferError(f"receiver {peer} speaks the {desc.get('backend')!r} backend, this engine {backend!r}")
    if not local.same_format(remote):
        raise KVTransferError(f"receiver {peer} has KV layout [{remote.describe()}], this pool "
                              f"[{local.describe()}]: pages of one do not fit the other")
    if len(src_pages) != len(dst_pages):
        raise KVTransferError(f"send to {peer}: {len(src_pages)} source pages for {len(dst_pages)} destination pages")
    _check_range(src_pages, local.num_pages, f"send to {peer}: source page", "this pool")
    _check_range(dst_pages, remote.num_pages, f"send to {peer}: destination page", "the receiver's pool")
    return desc, page_runs(src_pages, dst_pages)


def _check_range(pages: list[int], num_pages: int, what: str, whose: str) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise KVTransferError(f"{what} {bad[0]} is outside {whose} ({num_pages} pages)")
