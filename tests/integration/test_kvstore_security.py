"""The kvstore's integrity and auth over real gRPC on loopback: damaged pages reach the
client as misses; with tokens on, page calls need the fleet token and Clear the admin
token, both in the in-process servicer and in `radixmesh serve kvstore`."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import kvstore_pb2 as pb
from protos.radixmesh.v1 import kvstore_pb2_grpc, worker_pb2
from services.common.hicache_config import HiCacheConfig
from services.kvstore import page_file
from services.kvstore.auth import TokenAuth, bearer
from services.kvstore.client import KVStoreClient
from services.kvstore.memory_tier import Page
from services.kvstore.service import KVStoreService
from services.kvstore.store import KVStore, StoreConfig
from services.scheduler.main import SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from tests.integration.mesh_harness import Service
from tests.integration.test_kvstore_service import SPEC, chain, same

FLEET, ADMIN = "fleet-token-0123456789abcdef", "admin-token-0123456789abcdef"
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


async def start(store: KVStore, fleet: str | None = None, admin: str | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[TokenAuth(fleet, admin)])
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(store), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_damaged_pages_reach_the_client_as_misses(tmp_path: Path) -> None:
    store = KVStore(StoreConfig(memory_bytes=2 * SPEC.nbytes, disk_dir=str(tmp_path), disk_bytes=1 << 20))
    server, address = await start(store)
    client = KVStoreClient(address, SPEC)
    try:
        ids, keys, pages = chain(4)
        assert await client.put(keys, pages) == 4  # 0, 1 spilled to disk; 2, 3 in memory
        path = page_file.page_path(tmp_path, keys[0])
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x04
        path.write_bytes(bytes(raw))
        page = store.memory._pages[keys[3]]
        flipped = bytearray(page.payload)
        flipped[7] ^= 0x40
        store.memory._pages[keys[3]] = Page(bytes(flipped), page.crc)
        got = await client.get(keys, stop_at_miss=False)
        assert [g is not None for g in got] == [False, True, True, False]
        assert same(got[1], pages[1]) and same(got[2], pages[2])
        assert (await client.get_prefix(keys)).shape[0] == 0  # the chain breaks at page 0: recompute
        st = await client.stats()
        assert st.corrupt == 2 and client.counters.failures == 0 and client.counters.bad_pages == 0
    finally:
        await client.close()
        await server.stop(None)


async def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _codes(stub: kvstore_pb2_grpc.KVStoreStub, token: str | None) -> dict[str, grpc.StatusCode]:
    md = bearer(token)
    ids, keys, pages = chain(1, first=500)
    put = pb.PutPagesRequest(pages=[pb.Page(key=keys[0], data=b"\0" * SPEC.nbytes)])
    calls = {
        "Put": lambda: stub.Put(put, metadata=md, timeout=5),
        "PutStream": lambda: stub.PutStream(iter([put]), metadata=md, timeout=5),
        "Get": lambda: stub.Get(pb.GetPagesRequest(keys=keys), metadata=md, timeout=5),
        "GetStream": lambda: stub.GetStream(pb.GetPagesRequest(keys=keys), metadata=md, timeout=5),
        "Exists": lambda: stub.Exists(pb.ExistsRequest(keys=keys), metadata=md, timeout=5),
        "Stats": lambda: stub.Stats(pb.KVStoreStatsRequest(), metadata=md, timeout=5),
        "Clear": lambda: stub.Clear(pb.ClearRequest(), metadata=md, timeout=5),
    }
    return {name: await _code(call) for name, call in calls.items()}


async def test_page_calls_need_the_fleet_token_and_clear_the_admin_token() -> None:
    server, address = await start(KVStore(StoreConfig(memory_bytes=1 << 20)), FLEET, ADMIN)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            data = ["Put", "PutStream", "Get", "GetStream", "Exists", "Stats"]
            for token in (None, "wrong-token-0123456789", f"{FLEET}x"):
                assert set((await _codes(stub, token)).values()) == {UNAUTH}, token
            assert await _codes(stub, FLEET) == {**{m: grpc.StatusCode.OK for m in data}, "Clear": DENIED}
            assert set((await _codes(stub, ADMIN)).values()) == {grpc.StatusCode.OK}
            # Probes need no token.
            probe = health_pb2_grpc.HealthStub(channel)
            assert (await probe.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


async def test_without_an_admin_token_clear_is_off() -> None:
    server, address = await start(KVStore(StoreConfig(memory_bytes=1 << 20)), FLEET, None)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await _codes(stub, FLEET))["Clear"] == DENIED
            assert (await _codes(stub, None))["Clear"] == UNAUTH
    finally:
        await server.stop(None)


async def test_client_without_the_token_answers_misses_with_it_hits() -> None:
    server, address = await start(KVStore(StoreConfig(memory_bytes=1 << 20)), FLEET, ADMIN)
    anonymous = KVStoreClient(address, SPEC, retry_interval_s=0)
    member = KVStoreClient(address, SPEC, auth_token=FLEET)
    admin = KVStoreClient(address, SPEC, auth_token=ADMIN)
    try:
        ids, keys, pages = chain(3)
        assert await anonymous.put(keys, pages) == 0 and anonymous.counters.failures == 1
        assert await member.put(keys, pages) == 3
        assert await anonymous.exists(keys) == 0 and await anonymous.get(keys) == [None] * 3
        assert await member.exists(keys) == 3 and torch_equal(await member.get_prefix(keys), pages)
        assert await member.clear() is None and await member.exists(keys) == 0  # denied; backing off
        assert await admin.clear() == 3
    finally:
        for c in (anonymous, member, admin):
            await c.close()
        await server.stop(None)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and all(same(x, y) for x, y in zip(a, b))


async def test_the_schedulers_store_probe_sends_its_token_from_the_flag(tmp_path: Path) -> None:
    server, address = await start(KVStore(StoreConfig(memory_bytes=1 << 20)), FLEET, ADMIN)
    ids, keys, pages = chain(2)
    writer = KVStoreClient(address, SPEC, auth_token=FLEET)
    token_file = tmp_path / "fleet.token"
    token_file.write_text(FLEET + "\n")
    info = worker_pb2.WorkerInfo(page_size=SPEC.page_size, kvstore_addr=address, model=worker_pb2.ModelConfig(
        num_hidden_layers=SPEC.num_layers, num_key_value_heads=SPEC.num_kv_heads, head_dim=SPEC.head_dim))
    probes = []
    try:
        assert await writer.put(keys, pages) == 2
        for hicache in (HiCacheConfig(kvstore_auth_token_file=str(token_file)), HiCacheConfig()):
            probe = SchedulerService(SchedulerServiceConfig(hicache=hicache))._kvstore_probe(info)
            probe.probe_timeout_s = 5.0  # a loaded test machine: not the 0.2 s the request path allows
            probes.append(probe)
        with_token, without = probes
        assert await asyncio.to_thread(with_token.exists, keys) == 2
        assert await asyncio.to_thread(without.exists, keys) == 0
    finally:
        for p in probes:
            await asyncio.to_thread(p.close)
        await writer.close()
        await server.stop(None)


@pytest.mark.timeout(120)
async def test_serve_kvstore_requires_its_tokens(tmp_path: Path) -> None:
    (tmp_path / "fleet").write_text(FLEET)
    (tmp_path / "admin").write_text(ADMIN)
    svc = await asyncio.to_thread(lambda: Service(
        "kvstore", "--kvstore-auth-token-file", str(tmp_path / "fleet"),
        "--kvstore-admin-token-file", str(tmp_path / "admin")).wait_serving(60))  # health needs no token
    try:
        async with grpc.aio.insecure_channel(svc.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert set((await _codes(stub, None)).values()) == {UNAUTH}
            codes = await _codes(stub, FLEET)
            assert codes["Clear"] == DENIED and codes["Put"] == codes["Get"] == grpc.StatusCode.OK
            assert (await _codes(stub, ADMIN))["Clear"] == grpc.StatusCode.OK
        assert svc.stop() == 0
    finally:
        svc.stop()
    assert any('"kvstore call refused"' in line for line in svc.lines)


async def test_the_workers_store_client_sends_its_token_from_the_flag(tmp_path: Path) -> None:
    """The worker reads and writes pages too (services/worker/host_pool.py): with the fleet
    token from its flag its put lands and its reads hit; without it, both are refused."""
    from services.worker.host_pool import open_kvstore
    server, address = await start(KVStore(StoreConfig(memory_bytes=1 << 20)), FLEET, ADMIN)
    ids, keys, pages = chain(2)
    token_file = tmp_path / "fleet.token"
    token_file.write_text(FLEET + "\n")
    member = open_kvstore(HiCacheConfig(kvstore_addr=address, kvstore_auth_token_file=str(token_file)), SPEC)
    stranger = open_kvstore(HiCacheConfig(kvstore_addr=address), SPEC)
    for c in (member, stranger):
        c.probe_timeout_s = 5.0  # a loaded test machine: not the probe's default
    try:
        assert await asyncio.to_thread(stranger.put_nowait, keys, pages)
        await asyncio.to_thread(stranger.flush, 10.0)
        assert await asyncio.to_thread(member.exists, keys) == 0  # the stranger's put was refused
        assert await asyncio.to_thread(member.put_nowait, keys, pages)
        await asyncio.to_thread(member.flush, 10.0)
        assert await asyncio.to_thread(member.exists, keys) == 2
        assert same(await asyncio.to_thread(member.get_prefix, keys), pages)
        assert await asyncio.to_thread(stranger.exists, keys) == 0
    finally:
        for c in (member, stranger):
            await asyncio.to_thread(c.close)
        await server.stop(None)
