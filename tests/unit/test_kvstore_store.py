"""The KV store core: tiers, budgets, spills, checksums, restart, prefix lookup, clear."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.common.page_hash import KeyNamespace, PageHasher
from services.kvstore import page_codec, page_file
from services.kvstore.store import KVStore, StoreConfig

SPEC = page_codec.PageSpec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE = SPEC.nbytes  # 512 bytes


def keys_for(n: int, model: str = "toy", spec: page_codec.PageSpec = SPEC) -> list[bytes]:
    ns = KeyNamespace(model=model, weights_version="0", adapter="", page_size=spec.page_size,
                      kv_layout=spec.layout)
    return PageHasher(ns).keys(list(range(n * spec.page_size)))


def payloads(n: int, seed: int = 0) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [page_codec.encode(torch.randn(SPEC.shape, generator=g).to(SPEC.dtype), SPEC) for _ in range(n)]


def store(tmp_path: Path, memory_pages: float, disk_pages: float | None = 100) -> KVStore:
    return KVStore(StoreConfig(memory_bytes=int(memory_pages * PAGE),
                               disk_dir=None if disk_pages is None else str(tmp_path / "kv"),
                               disk_bytes=int((disk_pages or 0) * (PAGE + 100))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("memory_pages", [16, 0])  # served from memory, then from disk
def test_tensor_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype, memory_pages: int) -> None:
    spec = page_codec.PageSpec(3, 16, 2, 64, dtype)
    s = KVStore(StoreConfig(memory_bytes=memory_pages * spec.nbytes, disk_dir=str(tmp_path), disk_bytes=1 << 30))
    pages = torch.randn((4, *spec.shape)).to(dtype)
    pages[0, 0, 0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30]).to(dtype)
    keys = keys_for(4, spec=spec)
    assert s.put_many(zip(keys, [page_codec.encode(p, spec) for p in pages])).stored == 4
    got = [page_codec.decode(b, spec) for b in s.get_many(keys)]
    for want, have in zip(pages, got):
        assert have is not None and have.dtype == dtype
        assert torch.equal(want.view(torch.uint8), have.view(torch.uint8))  # bits, NaN included
    st = s.stats()
    assert (st.hits_memory, st.hits_disk) == ((4, 0) if memory_pages else (0, 4))


def test_codec_rejects_wrong_shapes_and_lengths() -> None:
    with pytest.raises(ValueError, match=r"page must be .* torch.bfloat16, got .* torch.float32"):
        page_codec.encode(torch.zeros(SPEC.shape, dtype=torch.float32), SPEC)
    assert page_codec.decode(b"\0" * (PAGE - 1), SPEC) is None


def test_memory_budget_spills_and_disk_serves(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=3)
    keys, data = keys_for(10), payloads(10)
    s.put_many(zip(keys, data))
    st = s.stats()
    assert st.memory_pages == 3 and st.memory_bytes <= 3 * PAGE
    assert st.disk_pages == 7 and st.spilled == 7
    assert s.get_many(keys[7:]) == data[7:]
    assert s.get_many(keys[:7]) == data[:7]  # from disk, promoted, each evicting the oldest
    st = s.stats()
    assert st.hits_disk == 7 and st.hits_memory == 3 and st.misses == 0
    assert st.memory_bytes <= 3 * PAGE
    assert st.spilled == 10  # keys[7:] were written when the promotions pushed them out
    assert s.get_many(keys[:7]) == data[:7]  # promoted pages re-evicted: no new writes
    assert s.stats().spilled == 10
    s.check_invariants()


def test_no_disk_tier_drops_evictions(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=2, disk_pages=None)
    keys, data = keys_for(5), payloads(5)
    s.put_many(zip(keys, data))
    assert s.get_many(keys) == [None, None, None, data[3], data[4]]
    assert s.stats().dropped == 3


def test_disk_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=0, disk_pages=4)
    keys, data = keys_for(6), payloads(6)
    s.put_many(zip(keys[:4], data[:4]))
    s.get_many([keys[0]])  # keys[0] becomes most recent: keys[1], keys[2] go first
    s.put_many(zip(keys[4:], data[4:]))
    assert [d is not None for d in s.get_many(keys)] == [True, False, False, True, True, True]
    assert s.stats().disk_evicted == 2
    s.check_invariants()


def test_put_skips_pages_already_stored(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=1)
    keys, data = keys_for(3), payloads(3)
    assert s.put_many(zip(keys, data)).stored == 3
    r = s.put_many(zip(keys, data))
    assert (r.stored, r.skipped) == (0, 3)
    assert s.put_many([(b"", b"x"), (keys[0], b"")]).rejected == 2


def _flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["payload", "header", "key", "truncate", "extend"])
def test_corrupt_page_reads_as_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    s = store(tmp_path, memory_pages=0)
    keys, data = keys_for(3), payloads(3)
    s.put_many(zip(keys, data))
    path = page_file.page_path(tmp_path / "kv", keys[1])
    size = path.stat().st_size
    if damage == "payload":
        _flip_byte(path, size - 7)
    elif damage == "header":
        _flip_byte(path, 9)
    elif damage == "key":
        _flip_byte(path, page_file.HEADER_BYTES + 3)
    elif damage == "truncate":
        os.truncate(path, size - 1)
    else:
        with open(path, "ab") as f:
            f.write(b"\0")
    assert s.get_many(keys) == [data[0], None, data[2]]
    assert not path.exists()
    assert s.stats().corrupt == 1 and s.stats().disk_pages == 2
    assert s.get_many(keys, stop_at_miss=True) == [data[0], None, None]


def test_restart_serves_from_disk_and_drops_damaged_files(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=2)
    keys, data = keys_for(6), payloads(6)
    s.put_many(zip(keys, data))
    # Everything in memory is lost with the process; spilled pages survive.
    on_disk = [k for k in keys if k in s.disk]
    assert len(on_disk) == 4
    os.truncate(page_file.page_path(tmp_path / "kv", keys[0]), 100)
    stray = page_file.page_path(tmp_path / "kv", keys[5]).with_name("x.page.1.2.tmp")
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"half")
    s2 = store(tmp_path, memory_pages=2)
    st = s2.stats()
    assert st.disk_pages == 3 and st.memory_pages == 0 and st.corrupt == 1
    assert not stray.exists()
    assert s2.get_many(keys) == [None, data[1], data[2], data[3], None, None]
    s2.check_invariants()


def test_exists_is_the_longest_stored_prefix(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=2)
    keys, data = keys_for(8), payloads(8)
    assert s.exists_prefix(keys) == 0
    s.put_many(zip(keys[:5], data[:5]))  # 3 on disk, 2 in memory
    s.put_many([(keys[6], data[6])])      # a gap at 5
    assert s.exists_prefix(keys) == 5
    assert s.exists_prefix(keys[:3]) == 3
    assert s.exists_prefix(keys_for(8, model="other")) == 0


def test_clear_empties_both_tiers(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=2)
    keys, data = keys_for(5), payloads(5)
    s.put_many(zip(keys, data))
    assert s.clear() == 5
    st = s.stats()
    assert (st.memory_pages, st.disk_pages, st.memory_bytes, st.disk_bytes) == (0, 0, 0, 0)
    assert s.get_many(keys) == [None] * 5
    assert not list((tmp_path / "kv").glob("*/*"))
    assert store(tmp_path, memory_pages=2).stats().disk_pages == 0  # and after a restart


def test_restart_ignores_a_directory_where_a_page_should_be(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=0)
    keys, data = keys_for(2), payloads(2)
    s.put_many(zip(keys, data))
    odd = page_file.page_path(tmp_path / "kv", keys_for(3)[2])
    odd.mkdir(parents=True)
    s2 = store(tmp_path, memory_pages=0)
    assert s2.get_many(keys) == data and s2.stats().disk_pages == 2
