"""Page integrity: every stored page carries a crc32 over its key and payload; a page that
fails it, in memory or on disk, is never served, is dropped and counted."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

from services.kvstore import page_file
from services.kvstore.memory_tier import Page
from services.kvstore.metrics import read_metrics
from services.kvstore.store import KVStore, StoreConfig
from tests.unit.test_kvstore_store import PAGE, keys_for, payloads, store


def _flip_in_memory(s: KVStore, key: bytes) -> None:
    """Damage the memory tier's copy of a page (bytes are immutable: swap in a flipped copy
    under the old checksum, as a bit flip in RAM would leave it)."""
    page = s.memory._pages[key]
    raw = bytearray(page.payload)
    raw[len(raw) // 2] ^= 0x10
    s.memory._pages[key] = Page(bytes(raw), page.crc)


def test_checksum_binds_the_key() -> None:
    a, b = keys_for(2)
    assert page_file.checksum(a, b"page") != page_file.checksum(b, b"page")
    assert page_file.checksum(a, b"page") != page_file.checksum(a, b"pagf")


def test_flipped_memory_page_is_not_served_dropped_and_counted(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=8, disk_pages=None)
    keys, data = keys_for(3), payloads(3)
    s.put_many(zip(keys, data))
    _flip_in_memory(s, keys[1])
    assert s.get_many(keys) == [data[0], None, data[2]]
    st = s.stats()
    assert st.corrupt == 1 and st.memory_pages == 2 and st.memory_bytes == 2 * PAGE and st.misses == 1
    assert read_metrics(s)["kvstore_corrupt"][2] == 1
    assert s.exists_prefix(keys) == 1  # dropped: no longer announced
    s.check_invariants()


def test_a_page_moved_to_another_key_fails_its_checksum(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=8, disk_pages=None)
    keys, data = keys_for(2), payloads(2)
    s.put_many(zip(keys, data))
    s.memory._pages[keys[1]] = s.memory._pages[keys[0]]  # right bytes, wrong key
    assert s.get_many(keys) == [data[0], None]
    assert s.stats().corrupt == 1


def test_damaged_memory_copy_falls_back_to_the_intact_file(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=1)
    keys, data = keys_for(2), payloads(2)
    s.put_many(zip(keys, data))                    # keys[0] spilled to disk
    assert s.get_many(keys[:1]) == [data[0]]       # promoted back; its file stays
    _flip_in_memory(s, keys[0])
    assert s.get_many(keys[:1]) == [data[0]]       # the disk copy, checked on its own
    st = s.stats()
    assert st.corrupt == 1 and st.hits_disk == 2
    s.check_invariants()


def test_flipped_disk_page_is_not_served_removed_and_counted(tmp_path: Path) -> None:
    s = store(tmp_path, memory_pages=0)
    keys, data = keys_for(2), payloads(2)
    s.put_many(zip(keys, data))
    path = page_file.page_path(tmp_path / "kv", keys[0])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x80
    path.write_bytes(bytes(raw))
    assert s.get_many(keys) == [None, data[1]]
    assert not path.exists() and s.stats().corrupt == 1
    assert read_metrics(s)["kvstore_corrupt"][2] == 1


def test_format_1_files_are_removed_at_start(tmp_path: Path) -> None:
    """Version 1 had a crc of the payload alone: such files must not be trusted under version 2."""
    key, payload = keys_for(1)[0], payloads(1)[0]
    head = struct.pack("<4sHHQI", page_file.MAGIC, 1, len(key), len(payload), zlib.crc32(payload))
    path = page_file.page_path(tmp_path / "kv", key)
    path.parent.mkdir(parents=True)
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)) + key + payload)
    s = KVStore(StoreConfig(memory_bytes=0, disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 20))
    assert not path.exists() and s.stats().corrupt == 1 and s.get_many([key]) == [None]
