"""The KV store over real gRPC on loopback: the client against an in-process server
(batched and streamed put/get, exists, clear, stats, down → misses → recovery), and
against `radixmesh serve kvstore` killed with SIGKILL and restarted over its directory."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import urllib.request
from pathlib import Path

import grpc
import torch

from protos.radixmesh.v1 import kvstore_pb2 as pb
from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common.page_hash import KeyNamespace, PageHasher
from services.kvstore import page_file
from services.kvstore.client import KVStoreClient
from services.kvstore.page_codec import PageSpec
from services.kvstore.service import KVStoreService
from services.kvstore.store import KVStore, StoreConfig
from tests.integration.mesh_harness import Service

SPEC = PageSpec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # 1 KiB
HASHER = PageHasher(KeyNamespace(model="toy", weights_version="0", adapter="", page_size=4, kv_layout=SPEC.layout))


def chain(n: int, first: int = 0) -> tuple[list[int], list[bytes], torch.Tensor]:
    ids = list(range(first, first + n * SPEC.page_size))
    g = torch.Generator().manual_seed(first)
    return ids, HASHER.keys(ids), torch.randn((n, *SPEC.shape), generator=g).to(SPEC.dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_server(store: KVStore, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(store), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


async def test_batched_and_streamed_put_get_exists_clear(tmp_path: Path) -> None:
    store = KVStore(StoreConfig(memory_bytes=8 * SPEC.nbytes, disk_dir=str(tmp_path), disk_bytes=1 << 20))
    server, port = await start_server(store)
    unary = KVStoreClient(f"127.0.0.1:{port}", SPEC)
    streamed = KVStoreClient(f"127.0.0.1:{port}", SPEC, max_batch_bytes=3 * SPEC.nbytes)  # forces streams
    try:
        ids, keys, pages = chain(20)
        assert await unary.exists(keys) == 0
        assert await unary.put(keys[:10], pages[:10]) == 10
        assert await streamed.put(keys, pages) == 10  # the first 10 are skipped
        assert await unary.stored_prefix_tokens(HASHER, ids + [1, 2]) == 80
        for client in (unary, streamed):
            got = await client.get(keys)
            assert all(same(g, p) for g, p in zip(got, pages))
            assert torch.equal(await client.get_prefix(keys), pages)
        # A gap: stop_at_miss cuts the chain there, unless asked not to.
        other_ids, other_keys, other_pages = chain(3, first=1000)
        mixed = keys[:2] + other_keys[:1] + keys[2:4]
        assert [g is not None for g in await streamed.get(mixed)] == [True, True, False, False, False]
        assert [g is not None for g in await streamed.get(mixed, stop_at_miss=False)] == \
            [True, True, False, True, True]
        assert (await unary.get_prefix(other_keys)).shape == (0, *SPEC.shape)
        # GetStream batches by bytes: one page per message at a one-page limit.
        stub = kvstore_pb2_grpc.KVStoreStub(unary._channel)
        msgs = [m async for m in stub.GetStream(pb.GetPagesRequest(keys=keys[:5], max_batch_bytes=SPEC.nbytes))]
        assert [len(m.pages) for m in msgs] == [1] * 5 and [m.pages[0].index for m in msgs] == list(range(5))
        # A payload of another layout under a key reads as a miss, not as garbage.
        await stub.Put(pb.PutPagesRequest(pages=[pb.Page(key=other_keys[0], data=b"x" * 10)]))
        assert await unary.get(other_keys[:1]) == [None] and unary.counters.bad_pages == 1
        st = await unary.stats()
        assert st.disk_enabled and st.memory_pages == 8 and st.disk_pages >= 12
        assert st.pages_stored == 21 and st.pages_skipped == 10 and st.hits_disk > 0
        assert await unary.clear() == 21
        assert await unary.exists(keys) == 0
        assert unary.counters.failures == streamed.counters.failures == 0
    finally:
        await unary.close()
        await streamed.close()
        await server.stop(None)


async def test_client_answers_misses_while_down_and_recovers(tmp_path: Path) -> None:
    port = free_port()
    client = KVStoreClient(f"127.0.0.1:{port}", SPEC, timeout_s=0.5, retry_interval_s=0.2)
    ids, keys, pages = chain(4)
    try:
        # Nothing listening: misses and no-ops, never an exception.
        assert await client.put(keys, pages) == 0
        assert await client.exists(keys) == 0
        assert await client.get(keys) == [None] * 4
        assert await client.clear() is None and await client.stats() is None
        assert not client.available and client.counters.failures == 1 and client.counters.skipped >= 3
        store = KVStore(StoreConfig(memory_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 20))
        server, _ = await start_server(store, port)
        for _ in range(100):  # back within a few retry intervals
            if await client.put(keys, pages) == 4:
                break
            await asyncio.sleep(0.05)
        assert client.available and await client.exists(keys) == 4
        await server.stop(None)
        assert await client.get(keys) == [None] * 4  # down again: misses
        server, _ = await start_server(store, port)
        for _ in range(100):
            got = await client.get(keys)
            if got[0] is not None:
                break
            await asyncio.sleep(0.05)
        assert all(same(g, p) for g, p in zip(got, pages))
        await server.stop(None)
    finally:
        await client.close()


async def test_serve_kvstore_survives_sigkill_with_its_disk_tier(tmp_path: Path) -> None:
    port = free_port()
    flags = ("--kvstore-disk-dir", str(tmp_path), "--kvstore-memory-bytes", str(2 * SPEC.nbytes))
    ids, keys, pages = chain(6)

    async def put_and_check(address: str) -> None:
        client = KVStoreClient(address, SPEC)
        assert await client.put(keys, pages) == 6
        assert (await client.stats()).disk_pages == 4  # 2 fit in memory
        await client.close()

    svc = await asyncio.to_thread(
        lambda: Service("kvstore", *flags, "--metrics-port", "0", listen=f"127.0.0.1:{port}").wait_serving(60))
    try:
        await put_and_check(svc.address)
        listening = next(json.loads(x) for x in svc.lines if '"listening"' in x)
        with urllib.request.urlopen(f"http://127.0.0.1:{listening['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'radixmesh:kvstore_disk_pages{model_name=""} 4.0' in text
        assert 'radixmesh:kvstore_bytes_in_total{model_name=""} %.1f' % (6 * SPEC.nbytes) in text
    finally:
        assert svc.stop(signal.SIGKILL) == -signal.SIGKILL
    # While it is down and after it restarts: the client neither raises nor lies.
    page_file.page_path(tmp_path, keys[3]).write_bytes(b"RMKV garbage")  # damaged while down

    async def across_restart() -> None:
        client = KVStoreClient(f"127.0.0.1:{port}", SPEC, timeout_s=0.5, retry_interval_s=0.2)
        assert await client.exists(keys) == 0 and await client.get(keys) == [None] * 6
        svc2 = await asyncio.to_thread(lambda: Service("kvstore", *flags, listen=f"127.0.0.1:{port}").wait_serving(60))
        try:
            for _ in range(100):
                if (n := await client.exists(keys)) > 0:
                    break
                await asyncio.sleep(0.05)
            # pages 0..3 had spilled; 3 was damaged (dropped at the restart scan); 4, 5 were only in memory
            assert n == 3
            got = await client.get(keys, stop_at_miss=False)
            assert [g is not None for g in got] == [True, True, True, False, False, False]
            assert all(same(g, p) for g, p in zip(got[:3], pages[:3]))
            st = await client.stats()
            assert st.hits_disk == 3 and st.corrupt == 1
            assert svc2.stop() == 0
        finally:
            svc2.stop(signal.SIGKILL)
            await client.close()

    await across_restart()


class _SlowService(KVStoreService):
    """A store whose Get never answers (until the server stops), and that counts every call it gets."""

    def __init__(self, store: KVStore) -> None:
        super().__init__(store)
        self.calls: dict[str, int] = {}
        self.never = asyncio.Event()

    async def Get(self, request, context):  # noqa: N802
        self.calls["Get"] = self.calls.get("Get", 0) + 1
        await self.never.wait()
        return await super().Get(request, context)

    async def Exists(self, request, context):  # noqa: N802
        self.calls["Exists"] = self.calls.get("Exists", 0) + 1
        return await super().Exists(request, context)


async def test_a_slow_store_times_out_into_misses() -> None:
    store = KVStore(StoreConfig(memory_bytes=1 << 20))
    server = grpc.aio.server()
    service = _SlowService(store)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # a backoff far longer than the test, so "still backing off" never depends on how fast the machine is
    client = KVStoreClient(f"127.0.0.1:{port}", SPEC, timeout_s=0.3, retry_interval_s=3600)
    try:
        ids, keys, pages = chain(2)
        assert await client.put(keys, pages) == 2
        # the store never answers: only the client's own deadline can end this call (30 s bounds a hang)
        assert await asyncio.wait_for(client.get(keys), timeout=30) == [None, None]
        assert client.counters.failures == 1
        exists_before = service.calls.get("Exists", 0)
        # backing off: answered with a miss without a call to the store
        assert await asyncio.wait_for(client.exists(keys), timeout=30) == 0
        assert client.counters.skipped == 1 and service.calls.get("Exists", 0) == exists_before
    finally:
        await client.close()
        await server.stop(None)
