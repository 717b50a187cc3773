"""HiCache, the worker's side: the host KV pool and the copies between tiers.

The scheduler decides every move and sends it as `StepPlan.kv_copies`
(services/step/contract.KVCopy); `KVTransfer.run` executes them in order
before the forward and reports pages, bytes and seconds per copy, which feed the
scheduler's load-or-recompute estimates. Tiers: DEVICE (the KV pool the model
reads), HOST (a pool of the same layout in host memory, pinned on CUDA), STORE
(the shared kvstore, through services/kvstore/blocking.BlockingKVStore). On a
CPU-only machine DEVICE and HOST are both host memory; the mechanics are the same.

A store page is [L, T, P, Hkv, D] (services/kvstore/page_codec), T the pool's tensors: 2 (k, v),
or 1 for an MLA latent pool, whose k [L, S, 1, D] alone holds bytes (its v is zero-width, V being
K's first latent_dim columns), so a latent page moves and is stored once. The pools are
k, v [L, S, Hkv, D] with page p at slots [p*P, (p+1)*P). Every tier holds the device pool's
storage dtype, so FP8 pages (--kv-cache-dtype) move as their bytes, half a bfloat16 page's
(the scale is the format's own, kernels/kv_fp8.py: nothing to carry beside a page).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import torch

from services.common.hicache_config import HiCacheConfig
from services.step.contract import DEVICE, HOST, STORE, KVCopy, KVTransferStat
from kernels.kv_fp8 import is_fp8
from services.worker.kv_pool import KVPool, KVPoolSpec, index_copy_rows, pool_zeros


class HostKVPool:
    """k, v [L, host_pages * P, Hkv, D] in host memory; a latent pool's v is zero-width
    [L, S, 1, 0] and allocates nothing (spec.v_head_dim)."""

    def __init__(self, spec: KVPoolSpec, pin: bool = False):
        self.spec = spec
        shape = (spec.num_layers, spec.num_slots, spec.num_kv_heads, spec.head_dim)
        self.k = pool_zeros(shape, spec.dtype, pin=pin)
        v_shape = (*shape[:3], spec.v_head_dim)
        self.v = pool_zeros(v_shape, spec.dtype, pin=pin) if spec.v_head_dim else torch.empty(v_shape, dtype=spec.dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold KV bytes, as KVPool.tensors: (k, v), or (k,) for a latent pool."""
        return (self.k,) if self.spec.is_latent else (self.k, self.v)


def page_slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """Slot indices [len(pages) * P] of `pages`, page by page."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1).to(device)


class KVTransfer:
    def __init__(self, device_pool: KVPool, host_pool: HostKVPool | None, store=None):
        """store: a BlockingKVStore (or anything with get_prefix / put_nowait), or None."""
        self.pools = {DEVICE: device_pool, HOST: host_pool}
        self.page_size = device_pool.spec.page_size
        self.page_bytes = device_pool.spec.bytes_per_token * self.page_size
        self.store = store

    @torch.inference_mode()
    def run(self, ops: list[KVCopy]) -> list[KVTransferStat]:
        """Execute the copies in order; one stat per copy. A copy naming a tier
        this worker lacks is a scheduler bug: ValueError."""
        stats = []
        for op in ops:
            t0 = time.perf_counter()
            if op.dst_tier == STORE:
                n = self._to_store(op)
            elif op.src_tier == STORE:
                n = self._from_store(op)
            else:
                n = self._copy(op)
            stats.append(KVTransferStat(n, n * self.page_bytes, time.perf_counter() - t0))
        return stats

    def _pool(self, tier: str):
        pool = self.pools.get(tier)
        if pool is None:
            raise ValueError(f"a KV copy names the {tier!r} tier, which this worker does not have")
        return pool

    def _copy(self, op: KVCopy) -> int:
        if len(op.src_pages) != len(op.dst_pages):
            raise ValueError(f"KV copy of {len(op.src_pages)} pages into {len(op.dst_pages)}")
        src, dst = self._pool(op.src_tier), self._pool(op.dst_tier)
        s = page_slots(op.src_pages, self.page_size, src.k.device)
        d = page_slots(op.dst_pages, self.page_size, dst.k.device)
        for a, b in zip(src.tensors, dst.tensors):  # [L, S, Hkv, D] each
            index_copy_rows(b, 1, d, a.index_select(1, s).to(b.device, non_blocking=True))
        return len(op.src_pages)

    def gather(self, tier: str, pages: list[int]) -> torch.Tensor:
        """Pages as store pages [n, L, T, P, Hkv, D] (T: 2, or 1 for a latent pool), a fresh CPU tensor."""
        pool, ps, n = self._pool(tier), self.page_size, len(pages)
        slots = page_slots(pages, ps, pool.k.device)
        L, _, h, d = pool.k.shape
        rows = [t.index_select(1, slots).view(L, n, ps, h, d) for t in pool.tensors]  # each [L, n, P, Hkv, D]
        stacked = torch.stack(rows, dim=2)  # [L, n, T, P, Hkv, D]
        return stacked.permute(1, 0, 2, 3, 4, 5).contiguous().cpu()

    def scatter(self, tier: str, pages: list[int], data: torch.Tensor) -> None:
        """Write store pages data [m, L, T, P, Hkv, D] into `pages`[:m] of `tier` (T: the pool's tensors)."""
        pool, ps, m = self._pool(tier), self.page_size, data.shape[0]
        if data.dim() != 6 or data.shape[2] != len(pool.tensors):
            raise ValueError(f"store pages {tuple(data.shape)} do not hold this pool's {len(pool.tensors)} KV "
                             "tensor(s) a page")
        slots = page_slots(pages[:m], ps, pool.k.device)
        d = data.permute(1, 0, 2, 3, 4, 5)  # [L, m, T, P, Hkv, D]
        L = d.shape[0]
        for i, dst in enumerate(pool.tensors):
            part = d[:, :, i].reshape(L, m * ps, *dst.shape[2:])
            if part.dtype != dst.dtype and (is_fp8(part.dtype) or is_fp8(dst.dtype)):
                raise ValueError(f"pages of {part.dtype} cannot enter a {dst.dtype} pool (FP8 bytes are not values)")
            index_copy_rows(dst, 1, slots, part.to(dst.device, dst.dtype))

    def _to_store(self, op: KVCopy) -> int:
        if len(op.keys) != len(op.src_pages):
            raise ValueError(f"{len(op.keys)} keys for {len(op.src_pages)} pages")
        if self.store is None or not op.src_pages:
            return 0
        # Gathered now: later copies in this plan and the forward may reuse these pages.
        self.store.put_nowait(op.keys, self.gather(op.src_tier, op.src_pages))
        return len(op.src_pages)

    def _from_store(self, op: KVCopy) -> int:
        if self.store is None or not op.keys:
            return 0
        data = self.store.get_prefix(op.keys[:len(op.dst_pages)])
        if data.shape[0]:
            self.scatter(op.dst_tier, op.dst_pages, data)
        return int(data.shape[0])


def model_identity(name: str, source: str | None) -> str:
    """A content identity for the KV namespace: the model's name plus a digest of
    its file(s) (size and the first MiB: a GGUF's header and metadata, a
    safetensors header), the same on every replica that loads the same bytes and
    different for any other model or a re-quantized file."""
    h = hashlib.blake2b(digest_size=16)
    files = []
    if source and os.path.isdir(source):
        files = sorted(os.path.join(source, f) for f in os.listdir(source)
                       if f.endswith((".safetensors", ".json", ".gguf")))
    elif source and os.path.exists(source):
        files = [source]
    for path in files:
        h.update(os.path.basename(path).encode() + os.path.getsize(path).to_bytes(8, "little"))
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
    return f"{name}:{h.hexdigest() if files else 'unknown-source'}"


def open_kvstore(hicache: HiCacheConfig, page):
    """The worker's client of the shared kvstore at --kvstore-addr (page: its PageSpec), with
    the fleet token when the store wants one."""
    from services.kvstore.blocking import BlockingKVStore
    return BlockingKVStore(hicache.kvstore_addr, page, timeout_s=hicache.kvstore_timeout_s,
                           auth_token=hicache.kvstore_auth_token())


def attach_tiers(runner, hicache: HiCacheConfig, source: str | None, cache_on: bool = True):
    """Give the runner its host pool and kvstore client as `hicache` asks
    (services/worker/host_pool.py). Returns (the store client or None, the
    ModelLimits fields that tell the scheduler about them)."""
    from services.kvstore.page_codec import PageSpec

    spec, mc = runner.kv_spec, runner.model_config
    page = PageSpec.from_pool(spec)
    store = None
    if hicache.kvstore_addr and cache_on:
        store = open_kvstore(hicache, page)
    host_pages = hicache.host_pages(spec.num_pages) if cache_on else 0
    host = None
    if host_pages:
        host = HostKVPool(dataclasses.replace(spec, num_pages=host_pages), pin=runner.device.type == "cuda")
    runner.kv_transfer = KVTransfer(runner.pool, host, store)
    fields = dict(host_pages=host_pages, page_bytes=spec.bytes_per_token * spec.page_size,
                  model_identity=model_identity(mc.name, source),
                  weights_version=str(getattr(runner, "weights_version", 0)), kv_layout=page.layout)
    return store, fields
