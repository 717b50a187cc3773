"""The KVStore gRPC servicer: protos ↔ the transport-free KVStore core.

Store calls do file I/O, so each runs on a worker thread (asyncio.to_thread);
the core is thread-safe, so concurrent RPCs proceed in parallel and the event
loop keeps answering health checks.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import kvstore_pb2 as pb
from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.kvstore.store import KVStore, PutResult, Stats

DEFAULT_STREAM_BATCH_BYTES = 16 << 20
_STREAM_LOOKUP_KEYS = 16  # keys looked up per thread hop while streaming


def stats_to_proto(s: Stats, disk_enabled: bool) -> pb.KVStoreStats:
    return pb.KVStoreStats(disk_enabled=disk_enabled, **dataclasses.asdict(s))


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    async def _put(self, request: pb.PutPagesRequest) -> PutResult:
        pages = [(p.key, p.data) for p in request.pages]
        return await asyncio.to_thread(self.store.put_many, pages)

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
        n = await asyncio.to_thread(self.store.exists_prefix, list(request.keys))
        return pb.ExistsResponse(prefix_pages=n)

    async def Clear(self, request: pb.ClearRequest, context: grpc.aio.ServicerContext) -> pb.ClearResponse:
        return pb.ClearResponse(pages_removed=await asyncio.to_thread(self.store.clear))

    async def Stats(self, request: pb.KVStoreStatsRequest, context: grpc.aio.ServicerContext) -> pb.KVStoreStats:
        return stats_to_proto(self.store.stats(), self.store.disk is not None)
