"""The gateway's requests on one GenerateStream call (radixmesh.v2.Tokenizer): one message per
step comes back with the outputs of every request on it, instead of one per request per step.

Each request registers its rid, sends its GenerateTextRequest with the traceparent of a client
span of its own, and reads the outputs dispatched to it; a request that is left early (the HTTP
client went away) is cancelled on the stream. When the call breaks, every request on it fails
with the call's status, and the next request opens a new call.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry.trace import SpanKind

from protos.radixmesh.v1 import tokenizer_pb2
from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from services.common import tracing
from services.common.outputs import RequestOutput


class StreamBroken(Exception):
    """The shared call ended: (grpc code name, message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Multiplexer:
    def __init__(self, open_call: Callable) -> None:
        """open_call: the stub's GenerateStream (called with the iterator of requests)."""
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._readers: dict[str, asyncio.Queue] = {}
        self.broken: StreamBroken | None = None
        self._call = open_call(self._requests())
        self._task = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[pb2.StreamRequest]:
        while True:
            msg = await self._outbox.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                self._dispatch(batch)
            broken = StreamBroken("UNAVAILABLE", "the tokenizer ended the GenerateStream call")
        except grpc.aio.AioRpcError as e:
            broken = StreamBroken(e.code().name, e.details() or "")
        except asyncio.CancelledError:
            broken = StreamBroken("CANCELLED", "the gateway closed the stream")
        self.broken = broken
        for reader in self._readers.values():
            reader.put_nowait(broken)

    def _dispatch(self, batch: opb.OutputBatch) -> None:
        per_request: dict[str, list] = {}
        for out in batch.outputs:
            per_request.setdefault(out.rid, []).append(out)
        for err in batch.errors:
            per_request.setdefault(err.rid, []).append(err)
        for rid, items in per_request.items():
            reader = self._readers.get(rid)
            if reader is not None:
                reader.put_nowait(items)

    async def generate(self, request: tokenizer_pb2.GenerateTextRequest,
                       to_events: Callable) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs as the Backend contract's batches (to_events: a message's
        outputs → events). Raises StreamBroken, or what to_events raises for a RequestError."""
        if self.broken is not None:
            raise self.broken
        rid, n = request.rid, request.n if request.HasField("n") else 1
        reader = self._readers[rid] = asyncio.Queue()
        span = tracing.tracer().start_span("tokenizer.generate", kind=SpanKind.CLIENT) if tracing.enabled() else None
        self._outbox.put_nowait(pb2.StreamRequest(generate=request,
                                                  traceparent=tracing.traceparent(span) if span else ""))
        open_ = set(range(n))
        try:
            while open_:
                items = await reader.get()
                if isinstance(items, StreamBroken):
                    raise items
                errors = [item for item in items if isinstance(item, opb.RequestError)]
                if errors:
                    open_.clear()
                    to_events(pb2.GenerateResponse(error=errors[0].error))  # raises its BackendError
                for item in items:
                    if item.HasField("finish"):
                        open_.discard(item.index)
                batch = to_events(pb2.GenerateResponse(outputs=items))
                if batch:
                    yield batch
        finally:
            del self._readers[rid]
            if open_ and self.broken is None:  # left early: abort it in the mesh
                self._outbox.put_nowait(pb2.StreamRequest(cancel=rid))
            if span is not None:
                span.end()

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
