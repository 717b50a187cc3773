"""`radixmesh serve kvstore` flags come from KVStoreConfig; metrics read the store's stats."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import parse_config
from services.kvstore.main import DEFAULT_LISTEN, KVStoreConfig
from services.kvstore.metrics import read_metrics
from services.kvstore.store import KVStore, StoreConfig


def test_flags_and_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = parse_config(KVStoreConfig, [])
    assert c.common.listen == DEFAULT_LISTEN and c.store == StoreConfig(1 << 30, None, 8 << 30)
    c = parse_config(KVStoreConfig, ["--kvstore-memory-bytes", "10", "--kvstore-disk-dir", str(tmp_path),
                                     "--kvstore-disk-bytes", "20", "--listen", "127.0.0.1:0"])
    assert c.store == StoreConfig(10, str(tmp_path), 20)
    with pytest.raises(SystemExit) as exit_:
        parse_config(KVStoreConfig, ["--kvstore-memory-bytes", "-1"])
    assert exit_.value.code == 2 and "--kvstore-memory-bytes must be >= 0, got -1" in capsys.readouterr().err
    assert c.kvstore_claim_ttl_s == 10.0
    assert parse_config(KVStoreConfig, ["--kvstore-claim-ttl-s", "2.5"]).kvstore_claim_ttl_s == 2.5
    with pytest.raises(SystemExit):
        parse_config(KVStoreConfig, ["--kvstore-claim-ttl-s", "0"])
    assert "--kvstore-claim-ttl-s must be > 0, got 0" in capsys.readouterr().err


def test_metrics_read_live_stats() -> None:
    assert read_metrics(None) is None  # not opened yet: nothing scraped
    store = KVStore(StoreConfig(memory_bytes=100))
    store.put_many([(b"k" * 32, b"x" * 40)])
    store.get_many([b"k" * 32, b"m" * 32])
    m = read_metrics(store)
    assert m["kvstore_memory_pages"] == ("gauge", "pages in the memory tier", 1)
    assert m["kvstore_hits_memory"][2] == 1 and m["kvstore_misses"][2] == 1
    assert m["kvstore_bytes_in"][2] == 40 and m["kvstore_bytes_out"][2] == 40
