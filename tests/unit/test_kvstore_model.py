"""The store against a model: whatever the sequence of puts, gets, damage, restarts and
clears, a get returns exactly what was put under that key or a miss, and budgets hold."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.kvstore import page_file
from services.kvstore.store import KVStore, StoreConfig

KEYS = [bytes([i]) * 32 for i in range(12)]
PAYLOADS = st.binary(min_size=1, max_size=300)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-model-"))
        self.config = StoreConfig(memory_bytes=700, disk_dir=str(self.dir), disk_bytes=2000)
        self.store = KVStore(self.config)
        self.truth: dict[bytes, bytes] = {}  # what was last accepted under each key

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=st.sampled_from(KEYS), payload=PAYLOADS)
    def put(self, key: bytes, payload: bytes) -> None:
        r = self.store.put_many([(key, payload)])
        if r.stored:
            self.truth[key] = payload

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5), stop=st.booleans())
    def get(self, keys: list[bytes], stop: bool) -> None:
        got = self.store.get_many(keys, stop_at_miss=stop)
        for i, (k, v) in enumerate(zip(keys, got)):
            assert v is None or v == self.truth.get(k)
            if stop and v is None:
                assert all(x is None for x in got[i:])

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def exists(self, keys: list[bytes]) -> None:
        n = self.store.exists_prefix(keys)
        assert all(k in self.truth for k in keys[:n])

    @rule(key=st.sampled_from(KEYS), cut=st.integers(0, 400), flip=st.booleans())
    def damage(self, key: bytes, cut: int, flip: bool) -> None:
        path = page_file.page_path(self.dir, key)
        if not path.exists():
            return
        raw = bytearray(path.read_bytes())
        if flip and cut < len(raw):
            raw[cut] ^= 0xFF
        else:
            raw = raw[:cut]
        path.write_bytes(bytes(raw))

    @rule()
    def restart(self) -> None:
        self.store = KVStore(self.config)

    @rule()
    def clear(self) -> None:
        self.store.clear()
        assert self.store.exists_prefix(KEYS[:1]) == 0

    @invariant()
    def budgets(self) -> None:
        self.store.check_invariants()


TestStoreModel = StoreMachine.TestCase
TestStoreModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
