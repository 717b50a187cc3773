"""An MLA latent KV pool (KVPoolSpec.latent_dim > 0: k [L, S, 1, D], v zero-width) through the
host tier, the kvstore page codec and the PD layout: its rows round-trip byte for byte, and
every page, store payload and transfer holds k alone, stored once (never a V, a copy or padding).
FP8 rides along: its pages are bytes like any other."""
from __future__ import annotations

import pytest
import torch

from services.kvstore.page_codec import PageSpec, decode_batch, encode
from services.step.contract import DEVICE, HOST, STORE, KVCopy
from services.worker.host_pool import HostKVPool, KVTransfer
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.kv_transfer.layout import PoolLayout

L, P, LATENT, ROPE = 3, 4, 32, 16  # the tiny DeepSeek-V3's numbers (tests/unit/tiny_models.DEEPSEEK)
D = LATENT + ROPE
DTYPES = [torch.float32, torch.float8_e4m3fn]


def latent_spec(num_pages: int, dtype: torch.dtype = torch.float32) -> KVPoolSpec:
    return KVPoolSpec(num_pages, P, L, 1, D, dtype, latent_dim=LATENT)


def filled_pool(dtype: torch.dtype, pages: int = 6, seed: int = 0) -> KVPool:
    """A latent pool whose every slot of every layer was written (FP8: rotated and rounded)."""
    pool = KVPool(latent_spec(pages, dtype))
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(pool.spec.num_slots)
    for layer in range(L):
        k = torch.randn(len(slots), 1, D, generator=g) * 3  # [T, 1, D]
        pool.write(layer, slots, k, k[..., :LATENT])
    return pool


def rows(pool, pages: list[int]) -> torch.Tensor:
    """k's bytes of `pages`, uint8 [L, len(pages) * P, 1, D * elem]."""
    slots = torch.tensor([p * P + i for p in pages for i in range(P)])
    return pool.k[:, slots].view(torch.uint8)


class DictStore:
    """BlockingKVStore's surface over a dict of encoded payloads (the real codec, no server)."""

    def __init__(self, spec: PageSpec):
        self.spec, self.data = spec, {}

    def put_nowait(self, keys, pages: torch.Tensor) -> None:
        for key, page in zip(keys, pages):
            self.data[key] = encode(page, self.spec)

    def get_prefix(self, keys) -> torch.Tensor:
        found = [self.data[k] for k in keys if k in self.data]
        pages, ok = decode_batch(found, self.spec)
        assert all(ok)
        return pages


def test_host_pool_of_a_latent_spec_allocates_no_v():
    host = HostKVPool(latent_spec(5))
    assert host.k.shape == (L, 5 * P, 1, D)
    assert host.v.shape == (L, 5 * P, 1, 0) and host.v.untyped_storage().nbytes() == 0
    assert host.tensors == (host.k,)
    ordinary = HostKVPool(KVPoolSpec(5, P, L, 2, 8, torch.float32))
    assert len(ordinary.tensors) == 2 and ordinary.v.shape == ordinary.k.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "fp8"])
def test_device_host_device_round_trip_keeps_the_rows(dtype):
    device = filled_pool(dtype)
    xfer = KVTransfer(device, HostKVPool(latent_spec(5, dtype)))
    original = rows(device, [1, 4]).clone()
    stat, = xfer.run([KVCopy(DEVICE, HOST, [1, 4], [3, 0])])
    assert stat.pages == 2 and stat.bytes == 2 * P * L * D * dtype.itemsize  # k alone
    assert torch.equal(rows(xfer.pools[HOST], [3, 0]), original)
    device.k.zero_()
    xfer.run([KVCopy(HOST, DEVICE, [0, 3], [5, 2])])
    assert torch.equal(rows(device, [2, 5]), original)
    assert not rows(device, [0, 1, 3, 4]).any()  # no other page written


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "fp8"])
def test_gather_scatter_and_the_store_move_k_once(dtype):
    device = filled_pool(dtype)
    page = PageSpec.from_pool(device.spec)
    store = DictStore(page)
    xfer = KVTransfer(device, None, store)
    pages = xfer.gather(DEVICE, [2, 0])
    assert pages.shape == (2, L, 1, P, 1, D) == (2, *page.shape)
    xfer.run([KVCopy(DEVICE, STORE, [2, 0], [], [b"a" * 32, b"b" * 32])])
    assert [len(p) for p in store.data.values()] == [L * P * D * dtype.itemsize] * 2
    fresh = KVPool(device.spec)
    stat, = KVTransfer(fresh, None, store).run([KVCopy(STORE, DEVICE, [], [4, 1], [b"a" * 32, b"b" * 32])])
    assert stat.pages == 2
    assert torch.equal(rows(fresh, [4, 1]), rows(device, [2, 0]))


def test_pages_of_an_ordinary_pool_cannot_enter_a_latent_one():
    xfer = KVTransfer(filled_pool(torch.float32), None)
    two = torch.zeros((1, L, 2, P, 1, D))  # [m, L, 2 (k, v), P, 1, D]
    with pytest.raises(ValueError, match="1 KV tensor"):
        xfer.scatter(DEVICE, [0], two)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "fp8"])
def test_a_latent_page_is_k_once_and_round_trips_through_the_codec(dtype):
    spec = latent_spec(2, dtype)
    page = PageSpec.from_pool(spec)
    assert page.latent_dim == LATENT and page.kv_tensors == 1 and page.shape == (L, 1, P, 1, D)
    assert page.nbytes == L * P * D * dtype.itemsize == spec.bytes_per_token * P
    data = KVTransfer(filled_pool(dtype), None).gather(DEVICE, [3])[0]
    back, ok = decode_batch([encode(data, page)], page)
    assert ok == [True] and torch.equal(back[0].view(torch.uint8), data.view(torch.uint8))


def test_a_latent_page_is_never_read_as_an_ordinary_one():
    latent = PageSpec(L, P, 1, D, torch.bfloat16, latent_dim=LATENT)
    ordinary = PageSpec(L, P, 1, D, torch.bfloat16)
    assert latent.layout == f"bfloat16:L{L}:KV1:H1:D{D}:latent{LATENT}"
    assert ordinary.layout == f"bfloat16:L{L}:KV2:H1:D{D}"  # unchanged: old keys still match
    assert PageSpec(L, P, 1, D, torch.bfloat16, latent_dim=16).layout != latent.layout
    fp8 = PageSpec(L, P, 1, D, torch.float8_e4m3fn, latent_dim=LATENT).layout
    assert fp8 == f"float8_e4m3fn*0.25+hadamard:L{L}:KV1:H1:D{D}:latent{LATENT}"
    # an ordinary payload is twice the length: a miss, never latent rows
    _, ok = decode_batch([bytes(ordinary.nbytes)], latent)
    assert ok == [False]
    with pytest.raises(ValueError, match="one KV head"):
        PageSpec(L, P, 2, D, torch.bfloat16, latent_dim=LATENT)


def test_a_latent_pool_layout_sends_k_alone_and_differs_from_an_ordinary_one():
    latent = PoolLayout.of(KVPool(latent_spec(8)))
    ordinary = PoolLayout.of(KVPool(KVPoolSpec(8, P, L, 1, D, torch.float32)))  # the same numbers, with a V
    assert latent.tensor_names == ("k",) and ordinary.tensor_names == ("k", "v")
    assert not latent.same_format(ordinary) and "latent 32" in latent.describe()
    assert latent.send_bytes(3) == 3 * L * P * D * 4 == ordinary.send_bytes(3) // 2
    assert PoolLayout(**latent.to_dict()) == latent  # a descriptor carries it
