"""The router over real gRPC on loopback, in-process, in front of scripted replicas:
which failures it retries on another replica (only "could not take it" codes, only before
any output), and that its health and the gateway's /ready follow the routable set at once."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.server import Readiness
from services.gateway.app import build_app
from services.gateway.backend import GrpcBackend
from services.gateway.config import GatewayConfig
from services.router.config import RouterConfig
from services.router.fleet import Fleet
from services.router.service import RouterAdmin, RouterFront, RouterFrontV2
from tests.doubles.v2_generate import V2Generate

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Code = grpc.StatusCode


@dataclass
class Script:
    """What replicas do, shared by all of them: the first `fail_first` attempts (fleet-wide) fail
    with `code`, as the call's status or (`as_event`) as the first event; `mid_stream` fails
    after one chunk instead."""
    code: Code | None = None
    fail_first: int = 10**9
    as_event: bool = False
    mid_stream: bool = False
    calls: list[str] = field(default_factory=list)  # replica name per Generate received


class ScriptedReplica(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, name: str, script: Script) -> None:
        self.name, self.script = name, script

    async def Info(self, request, context):
        return pb.InfoResponse(model_name="scripted", vocab_size=100, context_length=64, eos_token_ids=[0])

    async def Ready(self, request, context):
        return pb.ReadyResponse(ready=True)

    async def GetLoad(self, request, context):
        return pb.LoadReport()

    async def Generate(self, request, context):
        s = self.script
        s.calls.append(self.name)
        failing = s.code is not None and len(s.calls) <= s.fail_first
        if failing and s.mid_stream:
            yield cpb.GenerateResponse(chunk=cpb.GenerateChunk(index=0, token_ids=[5], text=self.name))
            await context.abort(s.code, f"{self.name} broke mid-stream")
        if failing and s.as_event:
            yield cpb.GenerateResponse(error=cpb.Error(code=s.code.value[0], message=f"{self.name} failed"))
            return
        if failing:
            await context.abort(s.code, f"{self.name} failed deterministically")
        yield cpb.GenerateResponse(chunk=cpb.GenerateChunk(index=0, token_ids=[5], text=self.name))
        yield cpb.GenerateResponse(finish=cpb.Finish(index=0, finish_reason=cpb.FINISH_REASON_LENGTH))


async def start_server(*servicers) -> tuple[grpc.aio.Server, str, health.aio.HealthServicer]:
    server = grpc.aio.server()
    for add, servicer in servicers:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", health_servicer


@dataclass
class Fixture:
    script: Script
    replicas: list[str]
    router: str
    channel: grpc.aio.Channel

    @property
    def front(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channel)

    @property
    def admin(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self.channel)

    async def health(self) -> int:
        resp = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return resp.status


@contextlib.asynccontextmanager
async def router_fleet(script: Script, n: int = 2, **router_flags):
    """n scripted replicas behind a router wired as `radixmesh serve router` wires it: the
    router's health mirrors its Readiness, tracked by the fleet once every replica is in."""
    servers, addresses = [], []
    for i in range(n):
        replica = ScriptedReplica(f"r{i}", script)
        server, address, _ = await start_server((tokenizer_pb2_grpc.add_TokenizerServicer_to_server, replica),
                                                (tokenizer2_grpc.add_TokenizerServicer_to_server, V2Generate(replica)))
        servers.append(server)
        addresses.append(address)
    config = RouterConfig(replica_addrs=addresses, retry_backoff_s=0.0, seed=0, health_interval_s=0.2,
                          breaker_failures=100, **router_flags)
    readiness = Readiness()
    fleet = Fleet(config, readiness)
    for address in addresses:
        fleet.add(address)
    fleet.start()
    front = RouterFront(config, fleet)
    router, router_addr, router_health = await start_server(
        (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, front),
        (tokenizer2_grpc.add_TokenizerServicer_to_server, RouterFrontV2(front)),
        (router_pb2_grpc.add_RouterServicer_to_server, RouterAdmin(config, fleet)))
    mirror = asyncio.ensure_future(readiness.mirror(lambda status: router_health.set("", status)))
    channel = grpc.aio.insecure_channel(router_addr)
    try:
        assert await fleet.wait_healthy(addresses, 20) == addresses
        fleet.track_readiness()
        yield Fixture(script, addresses, router_addr, channel)
    finally:
        mirror.cancel()
        await channel.close()
        await fleet.stop()
        for server in (router, *servers):
            await server.stop(0)


async def generate(stub) -> tuple[list, Code | None]:
    events, code = [], None
    call = stub.Generate(pb.GenerateTextRequest(text="hello", sampling=cpb.SamplingParams(max_new_tokens=1)),
                         timeout=30)
    try:
        async for event in call:
            events.append(event)
    except grpc.aio.AioRpcError as e:
        code = e.code()
    return events, code


# --- retries --------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [Code.INTERNAL, Code.UNKNOWN, Code.INVALID_ARGUMENT])
async def test_a_deterministic_failure_is_not_replayed_on_other_replicas(code):
    async with router_fleet(Script(code=code), n=3, max_retries=2) as f:
        events, got = await generate(f.front)
        assert got == code and events == []
        assert len(f.script.calls) == 1, f"replayed on {f.script.calls}"


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED])
@pytest.mark.parametrize("as_event", [False, True])
async def test_could_not_take_it_is_retried_on_another_replica(code, as_event):
    async with router_fleet(Script(code=code, fail_first=1, as_event=as_event)) as f:
        events, got = await generate(f.front)
        assert got is None
        first, second = f.script.calls
        assert first != second  # the retry went elsewhere
        assert events[0].chunk.text == second and events[-1].WhichOneof("event") == "finish"


async def test_an_internal_error_event_is_relayed_not_retried():
    async with router_fleet(Script(code=Code.INTERNAL, as_event=True)) as f:
        events, got = await generate(f.front)
        assert got is None and len(f.script.calls) == 1
        assert [e.WhichOneof("event") for e in events] == ["error"]
        assert events[0].error.code == Code.INTERNAL.value[0]


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.INTERNAL])
async def test_nothing_is_retried_once_output_started(code):
    async with router_fleet(Script(code=code, mid_stream=True)) as f:
        events, got = await generate(f.front)
        assert got is None and len(f.script.calls) == 1
        assert [e.WhichOneof("event") for e in events] == ["chunk", "error"]
        assert events[1].error.code == code.value[0] and "mid-stream" in events[1].error.message


# --- readiness --------------------------------------------------------------------------------

async def drain(f: Fixture, address: str, resume: bool = False) -> None:
    await f.admin.DrainReplica(router_pb2.DrainReplicaRequest(address=address, resume=resume), timeout=5)


async def test_router_health_follows_the_routable_set_at_once():
    async with router_fleet(Script()) as f:
        assert await f.health() == SERVING
        await drain(f, f.replicas[0])
        assert await f.health() == SERVING  # one replica is still routable
        await drain(f, f.replicas[1])
        assert await f.health() == NOT_SERVING
        ready = await f.front.Ready(pb.ReadyRequest(), timeout=5)
        assert not ready.ready and all("draining" in s.detail for s in ready.stages)
        await drain(f, f.replicas[1], resume=True)
        assert await f.health() == SERVING


@contextlib.asynccontextmanager
async def gateway(f: Fixture):
    # A poll an hour apart: only the admin route's check or the health watch can flip /ready.
    config = GatewayConfig(tokenizer_addr=f.router, ready_interval_s=3600)
    app = build_app(config, GrpcBackend(f.router, probe_timeout_s=5))
    async with TestClient(TestServer(app)) as client:
        await wait_ready(client, 200)  # the monitor's first check, at start-up
        yield client


async def wait_ready(client: TestClient, status: int, timeout: float = 20) -> None:
    """Until /ready answers `status` (bounded; far below the hour-long poll interval)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        r = await client.get("/ready")
        if r.status == status:
            return
        assert asyncio.get_running_loop().time() < deadline, f"/ready stayed {r.status}: {await r.text()}"
        await asyncio.sleep(0.05)


async def test_gateway_ready_is_503_right_after_the_admin_api_drained_every_replica():
    async with router_fleet(Script()) as f, gateway(f) as client:
        for address in f.replicas:
            r = await client.post(f"/admin/replicas/{address}/drain")
            assert r.status == 200
        r = await client.get("/ready")
        assert r.status == 503, await r.text()
        assert "draining" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "scripted", "prompt": "hi", "max_tokens": 1})
        assert r.status == 503
        assert (await client.post(f"/admin/replicas/{f.replicas[0]}/resume")).status == 200
        assert (await client.get("/ready")).status == 200


async def test_gateway_ready_follows_a_drain_done_behind_its_back():
    """Drained through the router's own admin RPC: the gateway learns it from the health watch."""
    async with router_fleet(Script()) as f, gateway(f) as client:
        for address in f.replicas:
            await drain(f, address)
        await wait_ready(client, 503)
        await drain(f, f.replicas[0], resume=True)
        await wait_ready(client, 200)


# --- admin ------------------------------------------------------------------------------------

async def test_gateway_admin_add_of_a_replica_that_is_not_serving_is_400_with_the_routers_reason():
    """The router's probe refuses it (FAILED_PRECONDITION): the caller's address is at fault, not the router."""
    async with router_fleet(Script()) as f, gateway(f) as client:
        server, address, health_servicer = await start_server()
        try:
            await health_servicer.set("", NOT_SERVING)
            r = await client.post("/admin/replicas", json={"address": address})
            error = (await r.json())["error"]
            assert r.status == 400, error
            assert error["code"] == "failed_precondition" and error["type"] == "invalid_request_error"
            assert address in error["message"] and "NOT_SERVING" in error["message"]
            listing = await (await client.get("/admin/replicas")).json()
            assert address not in {r["address"] for r in listing["replicas"]}
        finally:
            await server.stop(0)
