"""HiCache through the real model: the same greedy tokens whether a prefix's KV came
from the device pool, the host tier, the kvstore's memory or disk tier, or was
recomputed; damaged pages and a dead store fall back to recompute; two engines
share one store; another model identity or adapter never hits.

Small on purpose (2 shared cores): float32, a KV pool of ~10 prompts' worth of
tokens, prompts of ~60 tokens, 6 new tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import socket
import threading
from pathlib import Path

import grpc
import pytest

from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common.hicache_config import HiCacheConfig
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.kvstore.service import KVStoreService
from services.kvstore.store import KVStore, StoreConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M KV per token in float32


class StoreServer:
    """A real kvstore over loopback gRPC on its own thread; stop() is a kill (no drain)."""

    def __init__(self, disk_dir: Path, memory_bytes: int = 64 << 20, port: int = 0):
        self.config = StoreConfig(memory_bytes=memory_bytes, disk_dir=str(disk_dir), disk_bytes=1 << 30)
        self.port = port or free_port()
        self.store: KVStore | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "StoreServer":
        async def go():
            self.store = KVStore(self.config)  # a restart rebuilds the disk index from the directory
            server = grpc.aio.server()
            kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(self.store), server)
            server.add_insecure_port(self.address)
            await server.start()
            return server
        self._server = asyncio.run_coroutine_threadsafe(go(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(10)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(checkpoint, tokenizer, page_size, *, kv_tokens=640, **hicache) -> Engine:
    worker = WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=kv_tokens * TOKEN_BYTES,
                          max_requests=4)
    hc = HiCacheConfig(**{"hicache_prefetch_threshold": 16, "hicache_load_policy": "always", **hicache})
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=4), checkpoint=checkpoint,
                  tokenizer=tokenizer, hicache=hc)


def gen(eng: Engine, ids: list[int], namespace: str = ""):
    q: queue.SimpleQueue = queue.SimpleQueue()
    eng.submit(ids, GREEDY, q.put, namespace=namespace)
    tokens, cached = [], 0
    while True:
        chunk = q.get(timeout=120)
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
        if chunk.finished:
            return tokens, chunk.cached_tokens


@pytest.fixture(scope="module")
def prompts(tokenizer):
    system = ("You are a careful assistant for a public library. Answer briefly, cite the shelf "
              "section when you can, and never invent a book title that you are not sure exists. "
              "Visitors may be children, students or researchers; adapt your tone to each of them, "
              "and point them to the front desk for anything about membership cards. ")
    qs = ["Where are the atlases?", "Do you lend telescopes?", "What are the opening hours on Sunday?"]
    return [tokenizer.encode(system + q) for q in qs]


@pytest.fixture(scope="module")
def fillers(tokenizer):
    texts = [f"Filler text number {i}: " + "the quick brown fox jumps over the lazy dog " * 6 for i in range(6)]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module", params=[1, 16], ids=["ps1", "ps16"])
def page_size(request):
    return request.param


@pytest.fixture(scope="module")
def recomputed(checkpoint, tokenizer, prompts, page_size):
    eng = Engine(worker=WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=640 * TOKEN_BYTES,
                                     max_requests=4),
                 scheduler=SchedulerConfig(max_running_requests=4, disable_radix_cache=True),
                 checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        return [gen(eng, ids)[0] for ids in prompts]
    finally:
        eng.shutdown()


def test_device_and_host_tiers_give_the_recomputed_tokens(checkpoint, tokenizer, prompts, fillers, page_size,
                                                          recomputed):
    eng = engine(checkpoint, tokenizer, page_size, kv_tokens=160, host_kv_ratio=4.0)
    try:
        out, cached = gen(eng, prompts[0])
        assert out == recomputed[0] and cached == 0
        out, cached = gen(eng, prompts[1])  # the system prompt from the device pool
        assert out == recomputed[1] and cached >= 64
        for ids in fillers[:3]:  # push the system prompt out of the 160-token pool: demoted
            gen(eng, ids)
        s = eng.scheduler.stats
        assert s.pages_demoted > 0 and s.bytes_device_to_host > 0
        out, cached = gen(eng, prompts[2])  # its prefix comes back from the host tier
        assert out == recomputed[2] and cached >= 64
        assert s.host_hit_tokens >= 48 and s.bytes_host_to_device > 0
        eng.scheduler.check_invariants()
    finally:
        eng.shutdown()


def test_store_memory_tier_serves_a_second_engine(checkpoint, tokenizer, prompts, page_size, recomputed,
                                                           tmp_path):
    server = StoreServer(tmp_path / "kv").start()
    try:
        a = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            assert gen(a, prompts[0])[0] == recomputed[0]
            a.flush_kv_writes()
            assert a.scheduler.stats.pages_written_to_store > 0
        finally:
            a.shutdown()
        b = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)  # replica B: first sight
        try:
            out, cached = gen(b, prompts[1])
            assert out == recomputed[1] and cached >= 64, "the store's memory tier served B"
            assert b.scheduler.stats.store_hit_tokens >= 64
        finally:
            b.shutdown()
        assert server.store.stats().hits_memory > 0
    finally:
        server.close()


def test_disk_tier_across_a_restart_damaged_pages_and_a_dead_store(checkpoint, tokenizer, prompts, page_size,
                                                                    recomputed, tmp_path):
    server = StoreServer(tmp_path / "kv", memory_bytes=0).start()  # every page lands on disk
    try:
        a = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            gen(a, prompts[0])
            a.flush_kv_writes()
        finally:
            a.shutdown()
        server.stop()  # killed and restarted over the same directory: the disk tier serves
        server.start()
        c = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            out, cached = gen(c, prompts[2])
            assert out == recomputed[2] and cached >= 64, "the disk tier served after a restart"
            assert server.store.stats().hits_disk > 0
        finally:
            c.shutdown()
        b = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            # Two early pages of the shared prefix: one truncated, one with a flipped payload byte.
            keys = b.scheduler.hicache.keys.hasher("").keys(prompts[1][:64])
            files = [tmp_path / "kv" / f"{k[0]:02x}" / f"{k.hex()}.page" for k in keys[1:3]]
            files[0].write_bytes(files[0].read_bytes()[:-7])
            raw = bytearray(files[1].read_bytes())
            raw[-1] ^= 0xFF
            files[1].write_bytes(bytes(raw))
            out, _ = gen(b, prompts[1])
            assert out == recomputed[1]
            assert server.store.stats().corrupt >= 1
        finally:
            b.shutdown()
        server.stop()  # down: every request recomputes, none fails
        c = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            out, cached = gen(c, prompts[2])
            assert out == recomputed[2] and cached == 0
        finally:
            c.shutdown()
    finally:
        server.close()


def test_other_model_identity_or_adapter_never_hits(checkpoint, tokenizer, prompts, tmp_path):
    page_size = 16  # keys depend on the page size only through the namespace: one size suffices
    server = StoreServer(tmp_path / "kv").start()
    try:
        a = engine(checkpoint, tokenizer, page_size, kvstore_addr=server.address)
        try:
            gen(a, prompts[0])
            a.flush_kv_writes()
            _, cached = gen(a, prompts[1], namespace="adapter-7")  # same engine, another adapter
            assert cached == 0
        finally:
            a.shutdown()
        other = dataclasses.replace(checkpoint, source=str(tmp_path / "another-model.gguf"))
        b = engine(other, tokenizer, page_size, kvstore_addr=server.address)
        try:
            _, cached = gen(b, prompts[1])
            assert cached == 0 and b.scheduler.stats.store_hit_tokens == 0
        finally:
            b.shutdown()
    finally:
        server.close()
