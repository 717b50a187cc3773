"""KV transfer engines (services/worker/kv_transfer): real pools, real servers, real processes.

Every backend moves a non-contiguous page list into other page indices, byte for byte, and
leaves every other receiver page alone; refuses a receiver of another layout, naming both;
fails within its timeout against a dead (or stopped) receiver; closes idempotently. The
cross-process tests (marked slow) run the decode side in a spawned process.
"""
from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.kv_transfer import KVTransferError, create_engine, pool_storage
from services.worker.kv_transfer.layout import PageRun, PoolLayout, page_runs
from services.worker.kv_transfer.mooncake_engine import _engine_class
from services.worker.kv_transfer.shm_engine import mapped_file, shm_zeros

SRC = [1, 2, 3, 7, 9, 10, 30]  # runs 1-3, 7, 9-10, 30 ...
DST = [20, 21, 22, 0, 5, 6, 31]  # ... into 20-22, 0, 5-6, 31
WAIT_S = 30.0  # the most any step with a child process may take
DEAD_TIMEOUT_S = 3.0  # a sender's timeout where the receiver dies: the send must fail within it


def _mooncake_missing() -> str | None:
    try:
        _engine_class()
    except KVTransferError as e:
        return str(e)
    return None


MOONCAKE_MISSING = _mooncake_missing()
NEEDS_MOONCAKE = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"mooncake unavailable: {MOONCAKE_MISSING}")
BACKENDS = ["grpc", "shm", pytest.param("mooncake", marks=NEEDS_MOONCAKE)]
DTYPES = ["bfloat16", "float8_e4m3fn"]


def spec(dtype: str = "bfloat16", head_dim: int = 8) -> KVPoolSpec:
    return KVPoolSpec(num_pages=32, page_size=4, num_layers=4, num_kv_heads=3, head_dim=head_dim,
                      dtype=getattr(torch, dtype))


def random_pool(s: KVPoolSpec, seed: int, storage=None) -> KVPool:
    """A pool of random bytes (any bit pattern: the engines move bytes, never values)."""
    pool = KVPool(s, storage=storage)
    g = torch.Generator().manual_seed(seed)
    for t in (pool.k, pool.v):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return pool


def pool_bytes(pool: KVPool) -> tuple[np.ndarray, np.ndarray]:
    """Copies of k and v as uint8 [L, pages, page_bytes]."""
    lay = PoolLayout.of(pool)
    shape = (lay.num_layers, lay.num_pages, lay.page_bytes)
    return tuple(t.view(torch.uint8).reshape(shape).numpy().copy() for t in (pool.k, pool.v))


def assert_moved(before, after, sender, src: list[int], dst: list[int]) -> None:
    """after == before with dst pages replaced by the sender's src pages, in k and v."""
    for b, a, s in zip(before, after, sender):
        expect = b.copy()
        expect[:, dst] = s[:, src]
        np.testing.assert_array_equal(a, expect)


def bytes_of(s: KVPoolSpec, pages: int) -> int:
    return pages * 2 * s.num_layers * s.page_size * s.num_kv_heads * s.head_dim * s.dtype.itemsize


@contextlib.contextmanager
def engines(backend: str, decode_pool: KVPool, prefill_pool: KVPool, timeout_s: float = 10.0):
    decode = create_engine(backend, decode_pool, "decode", timeout_s=timeout_s)
    try:
        prefill = create_engine(backend, prefill_pool, "prefill", timeout_s=timeout_s)
        try:
            yield decode, prefill
        finally:
            prefill.close()
    finally:
        decode.close()


def test_page_runs_merge_pairs_that_advance_together() -> None:
    assert page_runs(SRC, DST) == [PageRun(1, 20, 3), PageRun(7, 0, 1), PageRun(9, 5, 2), PageRun(30, 31, 1)]
    assert page_runs([4, 5, 6], [8, 9, 11]) == [PageRun(4, 8, 2), PageRun(6, 11, 1)]
    assert page_runs([], []) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_send_moves_exactly_the_pages(backend: str, dtype: str) -> None:
    s = spec(dtype)
    receiver = random_pool(s, seed=1, storage=pool_storage(backend, "decode"))
    sender = random_pool(s, seed=2)
    before = pool_bytes(receiver)
    with engines(backend, receiver, sender) as (decode, prefill):
        assert prefill.send(decode.descriptor(), SRC, DST) == bytes_of(s, len(SRC))
        assert prefill.send(decode.descriptor(), [], []) == 0
    assert_moved(before, pool_bytes(receiver), pool_bytes(sender), SRC, DST)


@pytest.mark.parametrize("backend", ["grpc", "shm"])  # mooncake's batch has no chunks; the bench moves 64 MiB
def test_send_larger_than_a_chunk(backend: str) -> None:
    """9.4 MiB in one send: the gRPC stream cuts it into 4 MiB chunks."""
    s = KVPoolSpec(num_pages=160, page_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    receiver = random_pool(s, seed=3, storage=pool_storage(backend, "decode"))
    sender = random_pool(s, seed=4)
    src, dst = list(range(5, 155)), list(range(158, 8, -1))  # reversed: no runs merge on the receiver
    before = pool_bytes(receiver)
    with engines(backend, receiver, sender) as (decode, prefill):
        assert prefill.send(decode.descriptor(), src, dst) == bytes_of(s, 150)
    assert_moved(before, pool_bytes(receiver), pool_bytes(sender), src, dst)


# The check is the shared plan_send's: every backend for one mismatch, grpc for the other.
@pytest.mark.parametrize("backend, theirs", [
    ("grpc", dict(head_dim=16)), ("shm", dict(head_dim=16)),
    pytest.param("mooncake", dict(head_dim=16), marks=NEEDS_MOONCAKE),
    ("grpc", dict(dtype="float8_e4m3fn"))])
def test_a_receiver_of_another_layout_is_refused_naming_both(backend: str, theirs: dict) -> None:
    receiver = random_pool(spec(**theirs), seed=1, storage=pool_storage(backend, "decode"))
    sender = random_pool(spec(), seed=2)
    before = pool_bytes(receiver)
    with engines(backend, receiver, sender) as (decode, prefill):
        peer = json.loads(decode.descriptor())["peer"]
        with pytest.raises(KVTransferError) as err:
            prefill.send(decode.descriptor(), SRC, DST)
    for layout in (PoolLayout.of(receiver), PoolLayout.of(sender)):
        assert layout.describe() in str(err.value)
    assert peer in str(err.value)
    assert_moved(before, pool_bytes(receiver), before, [], [])


def test_the_grpc_receiver_refuses_a_stream_of_another_layout() -> None:
    """A descriptor that lies about the receiver's layout: the receiver itself says no."""
    receiver, sender = random_pool(spec(head_dim=16), seed=1), random_pool(spec(), seed=2)
    before = pool_bytes(receiver)
    with engines("grpc", receiver, sender) as (decode, prefill):
        desc = json.loads(decode.descriptor())
        desc["layout"] = PoolLayout.of(sender).to_dict()
        with pytest.raises(KVTransferError, match="INVALID_ARGUMENT") as err:
            prefill.send(json.dumps(desc), SRC, DST)
    assert PoolLayout.of(receiver).describe() in str(err.value)
    assert_moved(before, pool_bytes(receiver), before, [], [])


@pytest.mark.parametrize("backend", ["grpc", "shm"])  # plan_send's checks, before any backend runs
def test_pages_out_of_range_or_unpaired_are_refused(backend: str) -> None:
    receiver = random_pool(spec(), seed=1, storage=pool_storage(backend, "decode"))
    sender = random_pool(spec(), seed=2)
    with engines(backend, receiver, sender) as (decode, prefill):
        with pytest.raises(KVTransferError, match="destination page 32 is outside"):
            prefill.send(decode.descriptor(), [0, 1], [31, 32])
        with pytest.raises(KVTransferError, match="source page -1 is outside"):
            prefill.send(decode.descriptor(), [-1], [0])
        with pytest.raises(KVTransferError, match="2 source pages for 1 destination"):
            prefill.send(decode.descriptor(), [0, 1], [0])
        with pytest.raises(KVTransferError, match="not a KV transfer descriptor"):
            prefill.send("{}", [0], [0])
        with pytest.raises(KVTransferError, match="has no descriptor"):
            prefill.descriptor()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_is_idempotent_and_a_closed_receiver_fails_sends(backend: str) -> None:
    receiver = random_pool(spec(), seed=1, storage=pool_storage(backend, "decode"))
    sender = random_pool(spec(), seed=2)
    decode = create_engine(backend, receiver, "decode", timeout_s=DEAD_TIMEOUT_S)
    prefill = create_engine(backend, sender, "prefill", timeout_s=DEAD_TIMEOUT_S)
    desc = decode.descriptor()
    prefill.send(desc, SRC, DST)
    decode.close()
    decode.close()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match=re.escape(json.loads(desc)["peer"])):
        prefill.send(desc, SRC, DST)
    assert time.monotonic() - t0 < DEAD_TIMEOUT_S
    prefill.close()
    prefill.close()


def test_shm_files_are_sparse_and_gone_after_close() -> None:
    receiver = KVPool(spec(), storage=pool_storage("shm", "decode"))
    files = [mapped_file(t) for t in (receiver.k, receiver.v)]
    assert all(f.startswith("/dev/shm/radixmesh-kv-") for f in files) and files[0] != files[1]
    assert [os.stat(f).st_blocks for f in files] == [0, 0]  # no memory until written
    receiver.k[0, :4] = 1
    assert 0 < os.stat(files[0]).st_blocks * 512 <= 64 << 10
    decode = create_engine("shm", receiver, "decode")
    assert set(json.loads(decode.descriptor())[t] for t in ("k", "v")) == set(files)
    with pytest.raises(KVTransferError, match="already serves"):
        create_engine("shm", receiver, "decode")
    decode.close()
    assert not any(os.path.exists(f) for f in files)
    decode.close()


def test_shm_files_go_with_the_pool_without_an_engine() -> None:
    t = shm_zeros((2, 8), torch.bfloat16)
    path = mapped_file(t)
    assert os.path.exists(path)
    del t
    gc.collect()
    assert not os.path.exists(path)


def test_shm_decode_pool_must_be_in_shared_memory() -> None:
    with pytest.raises(KVTransferError, match=r"storage=pool_storage\('shm', 'decode'\)"):
        create_engine("shm", KVPool(spec()), "decode")


def test_registry_names_its_choices() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend 'nixl'; choose from grpc, mooncake, shm"):
        create_engine("nixl", KVPool(spec()), "decode")
    with pytest.raises(ValueError, match="unknown KV transfer role 'both'; choose from prefill, decode"):
        create_engine("grpc", KVPool(spec()), "both")
    assert pool_storage("grpc", "decode") is None and pool_storage("mooncake", "decode") is None
    assert pool_storage("shm", "prefill") is None and pool_storage("shm", "decode") is shm_zeros


def test_mooncake_missing_names_the_library_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # what a failed import leaves
    with pytest.raises(KVTransferError) as err:
        create_engine("mooncake", KVPool(spec()), "decode")
    for words in ("mooncake.engine", "apt-get install libibverbs1", "pip install mooncake-transfer-engine-non-cuda"):
        assert words in str(err.value)


# -- the decode side in another process --------------------------------------------------

def _decode_main(backends: list[str], conn: Connection) -> None:
    """A decode worker per backend, each a random pool behind an engine, in this one process:
    sends the descriptors, then answers ("dump" | "close", backend) until the parent hangs up."""
    pools = {b: random_pool(spec(), seed=1, storage=pool_storage(b, "decode")) for b in backends}
    engines_ = {b: create_engine(b, pools[b], "decode") for b in backends}
    conn.send({b: e.descriptor() for b, e in engines_.items()})
    try:
        while True:
            command, backend = conn.recv()
            if command == "dump":
                conn.send(pool_bytes(pools[backend]))
            else:
                engines_[backend].close()
                conn.send("closed")
    except EOFError:
        pass
    for engine in engines_.values():
        engine.close()


@dataclass
class DecodeProcess:
    proc: mp.process.BaseProcess
    conn: Connection
    descriptors: dict[str, str]

    def ask(self, command: str, backend: str):
        self.conn.send((command, backend))
        assert self.conn.poll(WAIT_S), f"the decode process did not answer {command!r} within {WAIT_S} s"
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies only once it runs
        self.proc.kill()
        self.proc.join(WAIT_S)


@contextlib.contextmanager
def decode_process(backends: list[str]):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(backends, child), daemon=True)
    proc.start()
    child.close()
    descriptors: dict[str, str] = {}
    try:
        assert conn.poll(WAIT_S), f"the decode process did not start within {WAIT_S} s"
        descriptors = conn.recv()
        yield DecodeProcess(proc, conn, descriptors)
    finally:
        conn.close()  # the child's EOF: it closes its engines and exits
        proc.join(WAIT_S)
        if proc.is_alive():
            DecodeProcess(proc, conn, descriptors).kill()
        for text in descriptors.values():  # a killed shm receiver leaves its files
            for path in (json.loads(text).get(t) for t in ("k", "v")):
                if path and os.path.exists(path):
                    os.unlink(path)


@pytest.fixture(scope="module")
def decode_host():
    """One spawned process serving every available backend (one start-up for all the tests)."""
    with decode_process(["grpc", "shm"] + (["mooncake"] if MOONCAKE_MISSING is None else [])) as decode:
        yield decode


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_send_to_a_decode_process_then_stopped_then_closed(decode_host: DecodeProcess, backend: str) -> None:
    descriptor = decode_host.descriptors[backend]
    sender = random_pool(spec(), seed=2)
    before = decode_host.ask("dump", backend)
    engine = create_engine(backend, sender, "prefill", timeout_s=DEAD_TIMEOUT_S)
    try:
        assert engine.send(descriptor, SRC, DST) == bytes_of(spec(), len(SRC))
        assert_moved(before, decode_host.ask("dump", backend), pool_bytes(sender), SRC, DST)
        if backend != "shm":  # a copy into shared memory does not wait for the receiver
            _assert_times_out_while_stopped(backend, sender, decode_host.proc.pid, descriptor)
        assert decode_host.ask("close", backend) == "closed"
        desc = json.loads(descriptor)
        assert not any(os.path.exists(desc.get(t, "/nonexistent")) for t in ("k", "v"))
        _assert_fails_fast(engine, descriptor)
    finally:
        engine.close()


@pytest.mark.slow
def test_shm_send_to_a_killed_decode_process_fails() -> None:
    """A receiver killed outright leaves its files, but not its lock: the sender sees it gone."""
    sender = random_pool(spec(), seed=2)
    with decode_process(["shm"]) as decode:
        descriptor = decode.descriptors["shm"]
        engine = create_engine("shm", sender, "prefill", timeout_s=DEAD_TIMEOUT_S)
        try:
            engine.send(descriptor, SRC, DST)
            decode.kill()
            assert decode.proc.exitcode == -signal.SIGKILL
            assert os.path.exists(json.loads(descriptor)["k"])
            _assert_fails_fast(engine, descriptor, match="is gone")
        finally:
            engine.close()


def _assert_fails_fast(engine, descriptor: str, match: str = "KV transfer to|is gone|does not exist") -> None:
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match=match):
        engine.send(descriptor, SRC, DST)
    assert time.monotonic() - t0 < DEAD_TIMEOUT_S


def _assert_times_out_while_stopped(backend: str, sender: KVPool, pid: int, descriptor: str) -> None:
    engine = create_engine(backend, sender, "prefill", timeout_s=1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|within 1.0 s"):
            engine.send(descriptor, SRC, DST)
        assert time.monotonic() - t0 < 3
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()
