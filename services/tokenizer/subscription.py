"""The tokenizer's end of the one-way output path: one Texts stream from the detokenizer carries
every request's outputs (one OutputBatch per step); each goes to the queue of the Generate call
that waits for it.

A request is registered here before it is submitted to the scheduler, so no output can arrive
before its reader. When the stream breaks, every open request fails with UNAVAILABLE and the
subscription is made again.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v2 import detokenizer_pb2 as dpb2
from protos.radixmesh.v2 import detokenizer_pb2_grpc as detokenizer2_grpc
from protos.radixmesh.v2 import outputs_pb2 as opb

log = logging.getLogger(__name__)

RECONNECT_S = 0.5


@dataclass(eq=False)
class RequestStream:
    """One request's outputs as they arrive: SequenceOutput or Error messages on `queue` (a
    Generate call reads them), or, with `mux` (a GenerateStream call's queue), gathered into
    one OutputBatch per step for all of that call's requests."""
    rid: str
    n: int
    mux: asyncio.Queue | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    open: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.open = set(range(self.n))

    async def take(self) -> list:
        """Wait for the next output, then take every one queued behind it."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


class TextSubscription:
    def __init__(self) -> None:
        self.name = f"tokenizer-{uuid.uuid4().hex[:12]}"
        self.streams: dict[str, RequestStream] = {}
        self.connected = asyncio.Event()
        self.down_reason: str | None = "not yet subscribed"

    def open(self, rid: str, n: int, mux: asyncio.Queue | None = None) -> RequestStream:
        stream = self.streams[rid] = RequestStream(rid, n, mux)
        return stream

    def close(self, rid: str) -> None:
        self.streams.pop(rid, None)

    async def follow(self, detokenizer_addr: str, channel: grpc.aio.Channel) -> None:
        """Forever: subscribe to the detokenizer's Texts and dispatch; on a break fail what is open."""
        stub = detokenizer2_grpc.DetokenizerStub(channel)
        while True:
            reason = await self._read(stub.Texts(dpb2.TextsRequest(subscriber=self.name)))
            self.connected.clear()
            self.down_reason = reason
            log.warning("outputs subscription lost", extra={"detokenizer": detokenizer_addr, "reason": reason})
            self.fail_all(grpc.StatusCode.UNAVAILABLE, reason)
            await asyncio.sleep(RECONNECT_S)

    async def _read(self, call) -> str:
        try:
            await call.initial_metadata()  # the detokenizer sends it once we are subscribed
            self.down_reason = None
            self.connected.set()
            async for batch in call:
                self.dispatch(batch)
            return "the detokenizer ended the outputs stream"
        except grpc.aio.AioRpcError as e:
            return f"the detokenizer's outputs stream broke: {e.code().name} {e.details() or ''}".rstrip()
        finally:
            call.cancel()

    def dispatch(self, batch: opb.OutputBatch) -> None:
        muxed: dict[asyncio.Queue, opb.OutputBatch] = {}
        for out in batch.outputs:
            stream = self.streams.get(out.rid)
            if stream is None:
                continue
            if stream.mux is None:
                stream.queue.put_nowait(out)
                continue
            muxed.setdefault(stream.mux, opb.OutputBatch()).outputs.append(out)
            if out.HasField("finish"):
                stream.open.discard(out.index)
                if not stream.open:
                    self.close(out.rid)
        for err in batch.errors:
            self._fail(self.streams.get(err.rid), err.error, muxed)
        for mux, muxed_batch in muxed.items():
            mux.put_nowait(muxed_batch)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        muxed: dict[asyncio.Queue, opb.OutputBatch] = {}
        for stream in list(self.streams.values()):
            self._fail(stream, cpb.Error(code=code.value[0], message=message), muxed)
        for mux, muxed_batch in muxed.items():
            mux.put_nowait(muxed_batch)

    def _fail(self, stream: RequestStream | None, error: cpb.Error, muxed: dict) -> None:
        if stream is None:
            return
        if stream.mux is None:
            stream.queue.put_nowait(error)
            return
        muxed.setdefault(stream.mux, opb.OutputBatch()).errors.append(opb.RequestError(rid=stream.rid, error=error))
        stream.open.clear()
        self.close(stream.rid)
