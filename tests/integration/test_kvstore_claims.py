"""Claims over real gRPC on loopback (services/kvstore/claims.py): an Exists that asks to wait
is answered once the pages another client claimed have landed, page batch by batch; it never
waits on its own claims, on an expired claim, or when it did not ask to; Puts release claims."""
from __future__ import annotations

import asyncio

import grpc
import torch

from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common.page_hash import KeyNamespace, PageHasher
from services.kvstore.claims import Claims
from services.kvstore.client import KVStoreClient
from services.kvstore.metrics import read_metrics
from services.kvstore.page_codec import PageSpec
from services.kvstore.service import KVStoreService
from services.kvstore.store import KVStore, StoreConfig

SPEC = PageSpec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
HASHER = PageHasher(KeyNamespace(model="toy", weights_version="0", adapter="", page_size=4, kv_layout=SPEC.layout))
KEYS = HASHER.keys(list(range(40)))  # 10 pages
PAGES = torch.randn((10, *SPEC.shape)).to(SPEC.dtype)
LONG = 60.0  # a wait that only a landing page (or a bug) ends; no test waits for it to pass


async def serve(claims: Claims) -> tuple[grpc.aio.Server, KVStoreService, str]:
    service = KVStoreService(KVStore(StoreConfig(memory_bytes=1 << 20)), claims)
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, service, f"127.0.0.1:{port}"


async def test_a_probe_waits_for_claimed_pages_batch_by_batch_and_puts_release_claims() -> None:
    server, service, address = await serve(Claims(ttl_s=600))
    writer, reader = KVStoreClient(address, SPEC), KVStoreClient(address, SPEC)
    try:
        assert await writer.exists(KEYS, claim_from=0) == 0 and len(service.claims) == 10
        assert await writer.exists(KEYS, wait_s=LONG) == 0  # its own claim: answered at once
        probe = asyncio.ensure_future(reader.exists(KEYS, wait_s=LONG))
        await asyncio.wait_for(service.claims.until_waits(1), LONG)
        assert await writer.put(KEYS[:4], PAGES[:4]) == 4  # the first batch lands; the 5th page is still claimed
        await asyncio.wait_for(service.claims.until_waits(2), LONG)
        assert not probe.done() and len(service.claims) == 6
        assert await writer.put(KEYS[4:], PAGES[4:]) == 6
        assert await asyncio.wait_for(probe, LONG) == 10 and len(service.claims) == 0
        m = read_metrics(service.store, service.claims)
        assert m["kvstore_exists_waits"][2] == 2 and m["kvstore_claims"][2] == 10
    finally:
        await writer.close()
        await reader.close()
        await server.stop(None)


async def test_no_wait_without_asking_after_expiry_or_for_a_claim_never_kept() -> None:
    now = [0.0]
    server, service, address = await serve(Claims(ttl_s=5, clock=lambda: now[0]))
    writer, reader = KVStoreClient(address, SPEC), KVStoreClient(address, SPEC)
    try:
        assert await writer.put(KEYS[:2], PAGES[:2]) == 2
        assert await writer.exists(KEYS, claim_from=0) == 2  # claims keys[2:], what it misses
        assert len(service.claims) == 8
        assert await reader.exists(KEYS) == 2  # a plain probe never waits
        now[0] = 5.0  # the claim expires, never kept
        assert await reader.exists(KEYS, wait_s=LONG) == 2
        assert service.claims.waits == 0
        assert await reader.exists(KEYS, claim_from=4) == 2  # claims from what it holds itself
        assert len(service.claims) == 6
    finally:
        await writer.close()
        await reader.close()
        await server.stop(None)
