"""The KVStore gRPC servicer: protos ↔ the transport-free KVStore core.

Store calls do file I/O, so each runs on a worker thread (asyncio.to_thread);
the core is thread-safe, so concurrent RPCs proceed in parallel and the event
loop keeps answering health checks. `Exists` may wait for pages another client
claimed and is still writing (services/kvstore/claims.py); the claims live on
this loop, and every Put releases the claims of its keys.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import kvstore_pb2 as pb
from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.kvstore.claims import Claims, ProbeOptions
from services.kvstore.store import KVStore, PutResult, Stats

DEFAULT_STREAM_BATCH_BYTES = 16 << 20
_STREAM_LOOKUP_KEYS = 16  # keys looked up per thread hop while streaming
_REPLY_MARGIN_S = 0.05  # a waiting Exists answers this long before the caller's deadline


def stats_to_proto(s: Stats, disk_enabled: bool) -> pb.KVStoreStats:
    return pb.KVStoreStats(disk_enabled=disk_enabled, **dataclasses.asdict(s))


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore, claims: Claims | None = None) -> None:
        self.store = store
        self.claims = claims if claims is not None else Claims()

    async def _put(self, request: pb.PutPagesRequest) -> PutResult:
        pages = [(p.key, p.data) for p in request.pages]
        try:
            return await asyncio.to_thread(self.store.put_many, pages)
        finally:
            self.claims.landed(key for key, _ in pages)

    async def Put(self, request: pb.PutPagesRequest, context: grpc.aio.ServicerContext) -> pb.PutPagesResponse:
        r = await self._put(request)
        return pb.PutPagesResponse(stored=r.stored, skipped=r.skipped, rejected=r.rejected)

    async def PutStream(self, request_iterator: AsyncIterator[pb.PutPagesRequest],
                        context: grpc.aio.ServicerContext) -> pb.PutPagesResponse:
        total = pb.PutPagesResponse()
        async for request in request_iterator:
            r = await self._put(request)
            total.stored += r.stored
            total.skipped += r.skipped
            total.rejected += r.rejected
        return total

    async def Get(self, request: pb.GetPagesRequest, context: grpc.aio.ServicerContext) -> pb.GetPagesResponse:
        keys = list(request.keys)
        found = await asyncio.to_thread(self.store.get_many, keys, request.stop_at_miss)
        return pb.GetPagesResponse(pages=[pb.Page(key=k, data=d, index=i)
                                          for i, (k, d) in enumerate(zip(keys, found)) if d is not None])

    async def GetStream(self, request: pb.GetPagesRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetPagesResponse]:
        keys = list(request.keys)
        limit = request.max_batch_bytes or DEFAULT_STREAM_BATCH_BYTES
        batch, batch_bytes = pb.GetPagesResponse(), 0
        for start in range(0, len(keys), _STREAM_LOOKUP_KEYS):
            chunk = keys[start:start + _STREAM_LOOKUP_KEYS]
            found = await asyncio.to_thread(self.store.get_many, chunk, request.stop_at_miss)
            for offset, (key, data) in enumerate(zip(chunk, found)):
                if data is None:
                    continue
                if batch.pages and batch_bytes + len(data) > limit:
                    yield batch
                    batch, batch_bytes = pb.GetPagesResponse(), 0
                batch.pages.append(pb.Page(key=key, data=data, index=start + offset))
                batch_bytes += len(data)
            if request.stop_at_miss and None in found:
                break
        if batch.pages:
            yield batch

    async def Exists(self, request: pb.ExistsRequest, context: grpc.aio.ServicerContext) -> pb.ExistsResponse:
        keys = list(request.keys)
        opts = ProbeOptions.from_metadata(context.invocation_metadata())
        n = await asyncio.to_thread(self.store.exists_prefix, keys)
        if opts.wait_s > 0:
            n = await self._wait_for_claimed(keys, n, opts, self._wait_budget(opts.wait_s, context))
        if opts.claim_from is not None:
            self.claims.claim(keys[max(n, opts.claim_from):], opts.client)
        return pb.ExistsResponse(prefix_pages=n)

    @staticmethod
    def _wait_budget(wait_s: float, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return wait_s if remaining is None else min(wait_s, remaining - _REPLY_MARGIN_S)

    async def _wait_for_claimed(self, keys: list[bytes], n: int, opts: ProbeOptions, budget_s: float) -> int:
        """The stored prefix once the keys other clients claimed right after it have
        landed, or `budget_s` passed, or a claim expired: n grows page batch by batch."""
        loop = asyncio.get_running_loop()
        end = loop.time() + budget_s
        while n < len(keys):
            timeout = min(end - loop.time(), self.claims.held_by_other(keys[n], opts.client))
            if timeout > 0:
                await self.claims.wait(keys[n], timeout)
            # Looked at again even unclaimed: a batch may have landed (and released its claims)
            # while the last look ran on its thread.
            more = await asyncio.to_thread(self.store.exists_prefix, keys[n:])
            if not more:
                break  # it did not land (timed out, refused, expired, never claimed): a miss from here on
            n += more
        return n

    async def Clear(self, request: pb.ClearRequest, context: grpc.aio.ServicerContext) -> pb.ClearResponse:
        return pb.ClearResponse(pages_removed=await asyncio.to_thread(self.store.clear))

    async def Stats(self, request: pb.KVStoreStatsRequest, context: grpc.aio.ServicerContext) -> pb.KVStoreStats:
        return stats_to_proto(self.store.stats(), self.store.disk is not None)
