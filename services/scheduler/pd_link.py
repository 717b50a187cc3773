"""The scheduler service's side of prefill/decode disaggregation: the PrefillBootstrap handshake
between the two schedulers of a pair (protos/radixmesh/v1/disaggregation.proto), on top of the
core's rooms (services/scheduler/disaggregation.py).

- A **prefill** scheduler serves `Attach`: the decode side's pages go into the core's room, and
  the room's events (progress, then Done or an error) go back on the call, with a heartbeat
  every `heartbeat_s`. A call that ends before Done (the decode side went away) aborts the
  request here, so its pages are freed.
- A **decode** scheduler attaches for every request whose pages the core reserved, and turns
  the call's end into `kv_arrived` or `kv_failed`. Every wait is bounded: silence longer than
  three heartbeats is a dead prefill side, named in the request's error.

Metrics: bytes, worker seconds and sends on the prefill side (GB/s is their ratio); on the
decode side, each request's wait from attaching to Done.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import disaggregation_pb2 as dpb
from protos.radixmesh.v1 import disaggregation_pb2_grpc as dpb_grpc
from services.common import metrics as m
from services.common import tls
from services.common.outputs_convert import logprob_from_proto, logprob_to_proto
from services.common.sampling_params import InvalidRequest
from services.scheduler.disaggregation import DECODE, PREFILL, Attachment, AttachNeeded, PDSpec, RoomEvent

log = logging.getLogger(__name__)

SILENT_HEARTBEATS = 3  # heartbeats missed before the other side counts as gone


def pd_spec(msg: cpb.Disaggregation) -> PDSpec | None:
    """The request's part in a pair, from its proto (None: co-located)."""
    role = {cpb.Disaggregation.PREFILL: PREFILL, cpb.Disaggregation.DECODE: DECODE}.get(msg.role)
    return None if role is None else PDSpec(role, msg.room, msg.bootstrap_address)


def event_to_proto(event: RoomEvent) -> dpb.AttachEvent:
    if event.kind == "progress":
        return dpb.AttachEvent(progress=dpb.Progress(pages_sent=event.pages, bytes_sent=event.bytes))
    if event.kind == "error":
        return dpb.AttachEvent(error=cpb.Error(code=grpc.StatusCode.UNAVAILABLE.value[0], message=event.error))
    done = dpb.PrefillDone(first_token_id=event.first_token, cached_tokens=event.cached_tokens, pages=event.pages,
                           bytes=event.bytes, transfer_seconds=event.seconds)
    if event.logprob is not None:
        done.logprob.CopyFrom(logprob_to_proto(event.logprob))
    return dpb.AttachEvent(done=done)


class PDMetrics:
    """The decode side's per-request transfer latency and failures (the prefill side's bytes,
    seconds and GB/s are read from its core at scrape time: services/scheduler/telemetry.py)."""

    def __init__(self, registry) -> None:
        self.wait = m.histogram(registry, "kv_transfer_request_seconds", "decode side: attaching to the prefill "
                                "side until its KV and first token are in", m.LATENCY_BUCKETS)
        self.failed = m.counter(registry, "kv_transfer_failed", "decode side: requests whose KV never arrived")


class PDLink:
    """One scheduler service's PD handshake: rooms' streams (prefill) or attach calls (decode)."""

    def __init__(self, service, heartbeat_s: float) -> None:
        self.service, self.heartbeat_s = service, heartbeat_s
        self.metrics = PDMetrics(service.telemetry.registry)
        self._streams: dict[str, asyncio.Queue] = {}  # prefill: room -> its Attach call's events
        self._attaching: dict[str, asyncio.Task] = {}  # decode: core rid -> its Attach call
        self._channels: dict[str, grpc.aio.Channel] = {}
        # decode: requests whose KV never came because the prefill side failed; their error is
        # UNAVAILABLE (nothing was streamed: the router may retry the pair elsewhere)
        self.unavailable: set[str] = set()
        self._ticker: asyncio.Task | None = None

    # --- every loop round (the scheduler service's deliver hook) --------------------------
    def pump(self, core) -> None:
        """Hand the core's room events to their calls; start the attaches it asks for."""
        if core.prefill_rooms is None and core.decode_rooms is None:
            return  # co-located: nothing to do, every step
        for event in core.take_room_events():
            queue = self._streams.get(event.room)
            if queue is not None:
                queue.put_nowait(event)
        for need in core.take_attach_needed():
            task = asyncio.create_task(self._attach(core, need), name=f"pd-attach-{need.rid}")
            self._attaching[need.rid] = task
            task.add_done_callback(lambda _t, rid=need.rid: self._attaching.pop(rid, None))

    def ended(self, rid: str) -> bool:
        """A decode-side request ended (aborted, say): its Attach call goes too, so the prefill
        side frees the room. True when it failed for the prefill side's fault."""
        task = self._attaching.pop(rid, None)
        if task is not None:
            task.cancel()
        if rid in self.unavailable:
            self.unavailable.discard(rid)
            return True
        return False

    def lost(self, reason: str) -> None:
        """The worker is gone (the core is rebuilt): every call ends."""
        for queue in self._streams.values():
            queue.put_nowait(RoomEvent("", "error", error=f"the prefill side lost its worker: {reason}"))
        for task in list(self._attaching.values()):
            task.cancel()

    def start_ticker(self) -> None:
        """While rooms wait on the other side, wake the loop each heartbeat so the core's timeouts run."""
        async def tick():
            while True:
                await asyncio.sleep(self.heartbeat_s)
                core = self.service.core
                if core is not None and core.prefill_rooms is not None and (
                        core.prefill_rooms.rooms or core.prefill_rooms.early):
                    self.service.wake()
        self._ticker = asyncio.create_task(tick(), name="pd-ticker")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._attaching.values()):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()

    # --- prefill side: Attach -----------------------------------------------------------
    async def serve_attach(self, request: dpb.AttachRequest, context) -> AsyncIterator[dpb.AttachEvent]:
        core, info = self.service.core, self.service.info
        if core is None or core.prefill_rooms is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler is not a prefill side "
                                "(--disaggregation-mode prefill), or has no worker connected")
        if request.kv_transfer_backend != info.kv_transfer_backend:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"the decode side sends with {request.kv_transfer_backend!r}, this prefill side with "
                f"{info.kv_transfer_backend!r}: both sides need the same --disaggregation-transfer-backend"))
        room, queue = request.room, asyncio.Queue()
        if room in self._streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {room!r} has a decode side attached already")
        self._streams[room] = queue
        ended = False
        try:
            core.attach_room(room, Attachment(request.kv_descriptor, list(request.dst_pages), request.skip_tokens,
                                              request.prompt_tokens, request.prompt_digest))
        except InvalidRequest as e:
            self._streams.pop(room, None)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.service.wake()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), self.heartbeat_s)
                except TimeoutError:
                    yield dpb.AttachEvent(heartbeat=dpb.Heartbeat())
                    continue
                yield event_to_proto(event)
                if event.kind in ("done", "error"):
                    ended = True
                    return
        finally:
            self._streams.pop(room, None)
            if not ended and self.service.core is core:  # the decode side went away
                core.detach_room(room)
                self.service.wake()

    # --- decode side: attach to the prefill side ------------------------------------------
    def _stub(self, address: str) -> dpb_grpc.PrefillBootstrapStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tls.aio_channel(address)
        return dpb_grpc.PrefillBootstrapStub(channel)

    async def _attach(self, core, need: AttachNeeded) -> None:
        info, address = self.service.info, need.bootstrap_address
        request = dpb.AttachRequest(
            room=need.room, kv_descriptor=info.kv_descriptor, kv_transfer_backend=info.kv_transfer_backend,
            dst_pages=need.dst_pages, skip_tokens=need.skip_tokens, prompt_tokens=need.prompt_tokens,
            prompt_digest=need.digest)
        started, silence = time.monotonic(), SILENT_HEARTBEATS * self.heartbeat_s
        call = self._stub(address).Attach(request)
        error = f"the prefill side at {address} closed room {need.room!r} without its KV"
        try:
            while True:
                event = await asyncio.wait_for(call.read(), silence)
                if event is grpc.aio.EOF:
                    break
                which = event.WhichOneof("event")
                if which == "done":
                    d = event.done
                    logprob = logprob_from_proto(d.logprob) if d.HasField("logprob") else None
                    core.kv_arrived(need.rid, d.first_token_id, logprob, d.cached_tokens)
                    self.metrics.wait.labels(self.service.telemetry.model).observe(time.monotonic() - started)
                    error = None
                    break
                if which == "error":
                    error = f"prefill side {address}: {event.error.message}"
                    break
        except TimeoutError:
            error = f"the prefill side at {address} sent nothing for {silence:g}s (room {need.room!r})"
        except grpc.aio.AioRpcError as e:
            error = f"the prefill side at {address} failed: {e.code().name} {e.details() or ''}".rstrip()
        except asyncio.CancelledError:
            error = None  # the request ended here; cancelling the call tells the prefill side
            raise
        finally:
            call.cancel()
            if error is not None and self.service.core is core:
                log.warning("KV did not arrive", extra={"rid": need.rid, "room": need.room, "error": error})
                self.metrics.failed.labels(self.service.telemetry.model).inc()
                self.unavailable.add(need.rid)
                core.kv_failed(need.rid, error)
            self.service.wake()


class PrefillBootstrapServicer(dpb_grpc.PrefillBootstrapServicer):
    def __init__(self, link_of) -> None:
        self._link_of = link_of  # () -> the service's PDLink (built at start)

    async def Attach(self, request, context):
        async for event in self._link_of().serve_attach(request, context):
            yield event
