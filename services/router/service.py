"""The router's servicers: radixmesh.v1.Tokenizer in front of the fleet, and radixmesh.v1.Router (admin).

Generate: the policy picks a replica (services/router/fleet.py) and the replica's stream is
relayed unchanged, with the retry rules of services/router/relay.py: an attempt that fails
before its first event with a code that says the replica could not take the request is retried
on another replica, at most max_retries times, after a backoff; the request then fails with the
last attempt's code. Cancelling the call cancels the attempt, which aborts the request in the
replica. On a disaggregated fleet (services/router/pools.py) each request runs on a prefill/decode
pair instead (services/router/pairing.py); everything else here then covers both pools.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.router import metrics
from services.router.fleet import Fleet, Replica
from services.router.keys import routing_key
from services.router.pairing import Pairing
from services.router.pools import Pools
from services.router.relay import REPLICA_FAULTS, RETRYABLE, V1, V2, Passthrough, Retry, Version, backoff, relay
from services.router.roles import COLOCATED

log = logging.getLogger(__name__)

__all__ = ["REPLICA_FAULTS", "RETRYABLE", "V1", "V2", "RouterAdmin", "RouterFront", "RouterFrontV2", "routing_key"]


class RouterFront(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, config, fleet: Fleet | Pools) -> None:
        self.config, self.pools = config, Pools.of(fleet)
        self._rng = random.Random(config.seed)
        self._info: pb.InfoResponse | None = None
        self.pairing = Pairing(config, self.pools, self._rng) if self.pools.disaggregated else None

    async def Generate(self, request: pb.GenerateTextRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        """radixmesh.v1's Generate, relayed to a replica's."""
        async for event in self.generate(request, context, V1):
            yield event

    async def generate(self, request: pb.GenerateTextRequest, context: grpc.aio.ServicerContext,
                       version: Version) -> AsyncIterator:
        """Pick a replica (a pair, when disaggregated), relay its stream; retry another one while
        nothing was streamed."""
        if self.pairing is not None:
            async for event in self.pairing.generate(request, context, version):
                yield event
            return
        fleet = self.pools.fleets[COLOCATED]
        if not request.rid:
            request.rid = uuid.uuid4().hex
        key = routing_key(request)
        tried: set[str] = set()
        last = (grpc.StatusCode.UNAVAILABLE, "no replica is available")
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff(self.config, self._rng, attempt))
            picked = fleet.choose(key, tried, request.adapter)
            if picked is None:
                break
            replica, _ = picked
            tried.add(replica.address)
            try:
                async for event in relay(replica, fleet, request, version):
                    yield event
                return
            except Passthrough as e:  # not retryable: the replica's verdict stands
                await context.abort(e.code, e.message)
            except grpc.aio.AioRpcError as e:  # the replica cancelled the call mid-stream
                await context.abort(e.code(), e.details() or "")
            except Retry as e:
                last = (e.code, f"{e.message} (replica {replica.address})")
                if attempt < self.config.max_retries:
                    metrics.RETRIES.labels(fleet.model_name, replica.address).inc()
                log.info("attempt failed before streaming", extra={
                    "rid": request.rid, "replica": replica.address, "code": e.code.name, "attempt": attempt + 1})
        await context.abort(last[0], last[1])

    # --- passthroughs: any healthy replica answers (all serve the same model) ----------------
    async def _any(self, method: str, request, context: grpc.aio.ServicerContext):
        every = [r for _, r in self.pools.replicas()]
        replicas = [r for r in every if r.healthy] or every
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
        """The model's Info. The router serves whole requests whatever its replicas' modes, so its
        own Info names no disaggregation mode nor bootstrap address."""
        if self._info is None:
            info = pb.InfoResponse()
            info.CopyFrom(await self._any("Info", request, context))
            info.ClearField("disaggregation_mode")
            info.ClearField("bootstrap_address")
            self._info = info
        return self._info

    async def Tokenize(self, request, context):
        return await self._any("Tokenize", request, context)

    async def ApplyChatTemplate(self, request, context):
        return await self._any("ApplyChatTemplate", request, context)

    async def Detokenize(self, request, context):
        return await self._any("Detokenize", request, context)

    async def Ready(self, request: pb.ReadyRequest, context: grpc.aio.ServicerContext) -> pb.ReadyResponse:
        """Ready when some routable replica's whole path is (disaggregated: some replica of each
        pool); one stage line per replica, named by its pool."""
        async def ask(replica: Replica) -> pb.StageHealth:
            stage = f"{replica.role} replica" if replica.role else "replica"
            if not replica.routable:
                return pb.StageHealth(stage=stage, address=replica.address, serving=False,
                                      detail=f"{replica.state}, circuit {replica.breaker.state}")
            try:
                r = await replica.stub.Ready(request, timeout=5)
            except grpc.aio.AioRpcError as e:
                return pb.StageHealth(stage=stage, address=replica.address, serving=False,
                                      detail=f"{e.code().name}: {e.details()}")
            down = "; ".join(f"{s.stage}: {s.detail}" for s in r.stages if not s.serving)
            return pb.StageHealth(stage=stage, address=replica.address, serving=r.ready, detail=down)

        replicas = [r for _, r in self.pools.replicas()]
        stages = await asyncio.gather(*(ask(r) for r in replicas))
        ready = all(any(s.serving for r, s in zip(replicas, stages) if r.role == role) for role in self.pools.fleets)
        return pb.ReadyResponse(ready=ready, stages=stages)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        """The fleet's sum over every pool (hit rate over the summed tokens; KV usage averaged)."""
        replicas = [r for _, r in self.pools.replicas()]
        reports = [r.report for r in replicas]
        hit = sum(r.cache_hit_tokens for r in reports)
        query = sum(r.cache_query_tokens for r in reports)
        return pb.LoadReport(
            num_running=sum(r.num_running for r in reports), num_waiting=sum(r.num_waiting for r in reports),
            in_flight=sum(r.in_flight for r in replicas),
            kv_usage=sum(r.kv_usage for r in reports) / len(reports) if reports else 0.0,
            cache_hit_tokens=hit, cache_query_tokens=query, cache_hit_rate=hit / query if query else 0.0)


class RouterAdmin(router_pb2_grpc.RouterServicer):
    """Replicas by address, whichever pool they are in."""

    def __init__(self, config, fleet: Fleet | Pools) -> None:
        self.config, self.pools = config, Pools.of(fleet)

    async def _find(self, address: str, context) -> tuple[Fleet, Replica]:
        found = self.pools.find(address)
        if found is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {address}")
        return found

    async def AddReplica(self, request, context):
        host, sep, port = request.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address must be HOST:PORT, got {request.address!r}")
        if self.pools.find(request.address) is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"replica {request.address} is already in the fleet")
        # Only a live replica (with TLS: a certified one) of a pool's mode joins, that pool.
        fleet, why = await self.pools.probe(request.address)
        if fleet is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replica {request.address} refused: {why}")
        return fleet.add(request.address).status()

    async def RemoveReplica(self, request, context):
        fleet, replica = await self._find(request.address, context)
        if not request.force:
            await fleet.retire(request.address, request.timeout_s or self.config.drain_wait_s)
        elif request.address in fleet.replicas:
            await fleet.remove(request.address)
        status = replica.status()
        status.state = "removed"
        return status

    async def DrainReplica(self, request, context):
        fleet, replica = await self._find(request.address, context)
        fleet.set_draining(replica, not request.resume)
        log.info("replica drain" if replica.draining else "replica resumed", extra={
            "replica": replica.address, "in_flight": replica.in_flight})
        return replica.status(fleet.tree_chars(replica.address))

    async def ListReplicas(self, request, context):
        every = sorted(self.pools.replicas(), key=lambda fr: (fr[1].role != "prefill", fr[1].address))
        return router_pb2.ListReplicasResponse(policy=self.pools.policy_name(self.config), replicas=[
            r.status(fleet.tree_chars(r.address)) for fleet, r in every])


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
