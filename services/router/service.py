"""The router's servicers: radixmesh.v1.Tokenizer in front of the fleet, and radixmesh.v1.Router (admin).

Generate: the policy picks a replica (services/router/fleet.py) and the replica's stream is
relayed unchanged. An attempt that fails before its first event with a code that says the
replica could not take the request — UNAVAILABLE (draining, down, worker gone) or
RESOURCE_EXHAUSTED (queue full), as the call's status or as its first event — is retried on
another replica, at most max_retries times, after a backoff (retry_backoff_s doubling per
retry, ±50 % jitter, capped); the request then fails with the last attempt's code. Any other
code passes straight to the client: INVALID_ARGUMENT (another replica would refuse it too),
INTERNAL and UNKNOWN (a failure the request itself may cause, which a retry would replay on
every replica). Once an event was relayed nothing is retried (the client has tokens): a
replica that goes away mid-stream ends the stream with one Error event naming it (with its
code). Cancelling the call cancels the attempt, which aborts the request in the replica.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.router import metrics
from services.router.fleet import Fleet, Replica

log = logging.getLogger(__name__)

# Codes that say "this replica could not take it", not "the request is wrong": retried elsewhere
# when nothing was relayed yet.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Codes that count against the replica's breaker (a fault of the replica, or possibly one).
REPLICA_FAULTS = RETRYABLE | {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED,
                              grpc.StatusCode.DEADLINE_EXCEEDED}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def routing_key(request: pb.GenerateTextRequest) -> str:
    """The text the prefix tree sees: namespace, then the prompt as the replica will render it
    (conversation turns in order; token ids as one character each)."""
    which = request.WhichOneof("prompt")
    if which == "text":
        body = request.text
    elif which == "conversation":
        body = "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.conversation.messages)
    elif which == "input_ids":
        body = "".join(chr(0x100 + (i % 0x10F000)) for i in request.input_ids.ids)
    else:
        body = ""
    return f"{request.namespace}\x00{request.adapter}\x00{body}"


class _Retry(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class _Passthrough(Exception):
    """The attempt failed with a code that is the client's answer (no retry)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


@dataclass(frozen=True)
class _Version:
    """How the router relays one version of the tokenizer's Generate."""
    call: Callable  # replica -> its Generate method
    response: type  # the stream's message class
    has_error: Callable  # message -> whether it is the request's error


V1 = _Version(lambda r: r.stub.Generate, cpb.GenerateResponse, lambda ev: ev.WhichOneof("event") == "error")
V2 = _Version(lambda r: r.stub_v2.Generate, pb2.GenerateResponse, lambda ev: ev.HasField("error"))


class RouterFront(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, config, fleet: Fleet) -> None:
        self.config, self.fleet = config, fleet
        self._rng = random.Random(config.seed)
        self._info: pb.InfoResponse | None = None

    async def Generate(self, request: pb.GenerateTextRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        """radixmesh.v1's Generate, relayed to a replica's."""
        async for event in self.generate(request, context, V1):
            yield event

    async def generate(self, request: pb.GenerateTextRequest, context: grpc.aio.ServicerContext,
                       version: "_Version") -> AsyncIterator:
        """Pick a replica, relay its stream; retry another one while nothing was streamed."""
        if not request.rid:
            request.rid = uuid.uuid4().hex
        key = routing_key(request)
        tried: set[str] = set()
        last = (grpc.StatusCode.UNAVAILABLE, "no replica is available")
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            picked = self.fleet.choose(key, tried, request.adapter)
            if picked is None:
                break
            replica, _ = picked
            tried.add(replica.address)
            try:
                async for event in self._attempt(replica, request, version):
                    yield event
                return
            except _Passthrough as e:  # not retryable: the replica's verdict stands
                await context.abort(e.code, e.message)
            except grpc.aio.AioRpcError as e:  # the replica cancelled the call mid-stream
                await context.abort(e.code(), e.details() or "")
            except _Retry as e:
                last = (e.code, f"{e.message} (replica {replica.address})")
                if attempt < self.config.max_retries:
                    metrics.RETRIES.labels(self.fleet.model_name, replica.address).inc()
                log.info("attempt failed before streaming", extra={
                    "rid": request.rid, "replica": replica.address, "code": e.code.name, "attempt": attempt + 1})
        await context.abort(last[0], last[1])

    async def _attempt(self, replica: Replica, request: pb.GenerateTextRequest,
                       version: "_Version") -> AsyncIterator:
        """Relay one attempt. Before its first event, a failure raises _Retry (RETRYABLE codes)
        or _Passthrough (any other); after it, the stream ends with an Error event."""
        call = version.call(replica)(request)
        started, outcome, code = False, None, ""
        try:
            async for event in call:
                error = _BY_VALUE.get(event.error.code) if version.has_error(event) else None
                if error in REPLICA_FAULTS:
                    outcome, code = False, error.name
                if not started and error in RETRYABLE:
                    raise _Retry(error, event.error.message)
                started = True
                yield event
            if code == "":
                outcome = True
        except grpc.aio.AioRpcError as e:
            outcome, code = (False, e.code().name) if e.code() in REPLICA_FAULTS else (None, "")
            if not started:
                raise (_Retry if e.code() in RETRYABLE else _Passthrough)(e.code(), e.details() or "") from None
            if e.code() == grpc.StatusCode.CANCELLED:
                raise  # the client went away: nothing to tell it
            metrics.MID_STREAM.labels(self.fleet.model_name, replica.address).inc()
            log.warning("replica failed mid-stream", extra={"rid": request.rid, "replica": replica.address,
                                                             "code": e.code().name})
            yield version.response(error=cpb.Error(
                code=e.code().value[0],
                message=f"replica {replica.address} failed mid-stream: {e.code().name} {e.details() or ''}".rstrip()))
        finally:
            call.cancel()  # no-op once ended; else aborts the request in the replica
            replica.end(outcome, code)
            self.fleet.update_readiness()  # a failure may have opened the last closed breaker

    def _backoff(self, retry: int) -> float:
        base = min(self.config.retry_backoff_max_s, self.config.retry_backoff_s * 2 ** (retry - 1))
        return base * self._rng.uniform(0.5, 1.5)

    # --- passthroughs: any healthy replica answers (all serve the same model) ----------------
    async def _any(self, method: str, request, context: grpc.aio.ServicerContext):
        replicas = [r for r in self.fleet.replicas.values() if r.healthy] or list(self.fleet.replicas.values())
        self._rng.shuffle(replicas)
        last = (grpc.StatusCode.UNAVAILABLE, "no replica is available")
        for replica in replicas[:3]:
            try:
                return await getattr(replica.stub, method)(request, timeout=30)
            except grpc.aio.AioRpcError as e:  # unary reads: asking another replica replays nothing
                if e.code() not in REPLICA_FAULTS:
                    await context.abort(e.code(), e.details() or "")
                last = (e.code(), f"{e.details()} (replica {replica.address})")
        await context.abort(*last)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if self._info is None:
            self._info = await self._any("Info", request, context)
        return self._info

    async def Tokenize(self, request, context):
        return await self._any("Tokenize", request, context)

    async def ApplyChatTemplate(self, request, context):
        return await self._any("ApplyChatTemplate", request, context)

    async def Ready(self, request: pb.ReadyRequest, context: grpc.aio.ServicerContext) -> pb.ReadyResponse:
        """Ready when some routable replica's whole path is; one stage line per replica."""
        async def ask(replica: Replica) -> pb.StageHealth:
            if not replica.routable:
                return pb.StageHealth(stage="replica", address=replica.address, serving=False,
                                      detail=f"{replica.state}, circuit {replica.breaker.state}")
            try:
                r = await replica.stub.Ready(request, timeout=5)
            except grpc.aio.AioRpcError as e:
                return pb.StageHealth(stage="replica", address=replica.address, serving=False,
                                      detail=f"{e.code().name}: {e.details()}")
            down = "; ".join(f"{s.stage}: {s.detail}" for s in r.stages if not s.serving)
            return pb.StageHealth(stage="replica", address=replica.address, serving=r.ready, detail=down)

        stages = await asyncio.gather(*(ask(r) for r in list(self.fleet.replicas.values())))
        return pb.ReadyResponse(ready=any(s.serving for s in stages), stages=stages)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        """The fleet's sum (hit rate over the summed tokens; KV usage averaged)."""
        reports = [r.report for r in self.fleet.replicas.values()]
        hit = sum(r.cache_hit_tokens for r in reports)
        query = sum(r.cache_query_tokens for r in reports)
        return pb.LoadReport(
            num_running=sum(r.num_running for r in reports), num_waiting=sum(r.num_waiting for r in reports),
            in_flight=sum(r.in_flight for r in self.fleet.replicas.values()),
            kv_usage=sum(r.kv_usage for r in reports) / len(reports) if reports else 0.0,
            cache_hit_tokens=hit, cache_query_tokens=query, cache_hit_rate=hit / query if query else 0.0)


class RouterAdmin(router_pb2_grpc.RouterServicer):
    def __init__(self, config, fleet: Fleet) -> None:
        self.config, self.fleet = config, fleet

    def _get(self, address: str) -> Replica | None:
        return self.fleet.replicas.get(address)

    async def AddReplica(self, request, context):
        host, sep, port = request.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address must be HOST:PORT, got {request.address!r}")
        if request.address in self.fleet.replicas:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"replica {request.address} is already in the fleet")
        why = await self.fleet.probe(request.address)  # only a live replica (with TLS: a certified one) joins
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replica {request.address} refused: {why}")
        replica = self.fleet.add(request.address)
        return replica.status()

    async def RemoveReplica(self, request, context):
        replica = self._get(request.address)
        if replica is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.address}")
        if not request.force:
            await self.fleet.retire(request.address, request.timeout_s or self.config.drain_wait_s)
        elif request.address in self.fleet.replicas:
            await self.fleet.remove(request.address)
        status = replica.status()
        status.state = "removed"
        return status

    async def DrainReplica(self, request, context):
        replica = self._get(request.address)
        if replica is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.address}")
        self.fleet.set_draining(replica, not request.resume)
        log.info("replica drain" if replica.draining else "replica resumed", extra={
            "replica": replica.address, "in_flight": replica.in_flight})
        return replica.status(self.fleet.tree_chars(replica.address))

    async def ListReplicas(self, request, context):
        return router_pb2.ListReplicasResponse(policy=self.config.policy, replicas=[
            r.status(self.fleet.tree_chars(r.address))
            for r in sorted(self.fleet.replicas.values(), key=lambda r: r.address)])


class RouterFrontV2(tokenizer2_grpc.TokenizerServicer):
    """radixmesh.v2's Generate, relayed to a replica's like v1's."""

    def __init__(self, front: RouterFront) -> None:
        self.front = front

    async def Generate(self, request: pb.GenerateTextRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async for event in self.front.generate(request, context, V2):
            yield event

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Not relayed (each request of it could go to another replica): UNIMPLEMENTED, on which a
        gateway sends each request on a Generate call of its own. The generated base class's
        NotImplementedError would reach clients as UNKNOWN."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the router relays Generate, not GenerateStream")
        yield  # an async generator, as grpc.aio expects of a streaming method
