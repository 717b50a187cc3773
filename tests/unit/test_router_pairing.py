"""The router's disaggregated path (services/router/pairing.py) over real gRPC on loopback, in
process, in front of fake prefill and decode replicas (their Info reports the mode and, for
prefill, a bootstrap address; their Generate records what it got): both sides get the request
with their part of the pair, the client gets the decode side's stream only, a side that could not
take the request is avoided on the retry, misconfigured replicas are refused, n > 1 is refused,
and a client's cancel reaches both sides."""
from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.server import Readiness
from services.router.config import RouterConfig
from services.router.main import admit_listed
from services.router.pools import Pools
from services.router.service import RouterAdmin, RouterFront, RouterFrontV2
from tests.doubles.v2_generate import V2Generate

Code = grpc.StatusCode
PREFILL, DECODE = cpb.Disaggregation.PREFILL, cpb.Disaggregation.DECODE
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Faults:
    """Shared by the replicas of one pool: the pool's first `times` Generate calls fail with `code`."""
    code: Code | None = None
    times: int = 10**9
    calls: list[str] = field(default_factory=list)  # replica names, per Generate received


# room -> set once a prefill side sampled its first token (the KV "arrived"); a decode side waits
# for it before it streams, as a real one waits for the prefill side's Done. Every fake and the
# router share one event loop, so the fakes can share this.
ROOMS: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)


class FakeSide(tokenizer_pb2_grpc.TokenizerServicer):
    """A replica of one mode. Prefill: one chunk (which opens its room), then a finish. Decode:
    once its room is open, two chunks, then a finish. `hold`: wait for a cancel (prefill: before
    its chunk, or after it with `hold_after_first`; decode: after its first chunk)."""

    def __init__(self, name: str, mode: str, faults: Faults, bootstrap: str | None = None) -> None:
        self.name, self.mode, self.faults = name, mode, faults
        self.bootstrap = f"{name}-bootstrap:50052" if bootstrap is None and mode == "prefill" else (bootstrap or "")
        self.hold = self.hold_after_first = False
        self.requests: list[pb.GenerateTextRequest] = []
        self.cancelled = asyncio.Event()
        self.address = ""

    async def Info(self, request, context):
        return pb.InfoResponse(model_name="pd-fake", vocab_size=100, context_length=64, eos_token_ids=[0],
                               disaggregation_mode=self.mode, bootstrap_address=self.bootstrap)

    async def Ready(self, request, context):
        return pb.ReadyResponse(ready=True)

    async def GetLoad(self, request, context):
        return pb.LoadReport(num_running=1 if self.mode == "prefill" else 2)

    async def Generate(self, request, context):
        self.requests.append(request)
        self.faults.calls.append(self.name)
        if self.faults.code is not None and len(self.faults.calls) <= self.faults.times:
            await context.abort(self.faults.code, f"{self.name} could not take it")
        room = request.disaggregation.room
        try:
            if self.mode == "prefill":
                if self.hold:
                    await asyncio.Event().wait()
                ROOMS[room].set()
                yield _chunk(7, f"{self.name}:first")
                if self.hold_after_first:
                    await asyncio.Event().wait()
            else:
                await ROOMS[room].wait()
                yield _chunk(7, f"{self.name}:0")
                if self.hold:
                    await asyncio.Event().wait()
                yield _chunk(8, f"{self.name}:1")
            yield cpb.GenerateResponse(finish=cpb.Finish(index=0, finish_reason=cpb.FINISH_REASON_LENGTH))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def _chunk(token: int, text: str) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(chunk=cpb.GenerateChunk(index=0, token_ids=[token], text=text))


async def _serve(*servicers) -> tuple[grpc.aio.Server, str, health.aio.HealthServicer]:
    server = grpc.aio.server()
    for add, servicer in servicers:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", health_servicer


async def _serve_replica(replica: FakeSide) -> grpc.aio.Server:
    server, replica.address, _ = await _serve((tokenizer_pb2_grpc.add_TokenizerServicer_to_server, replica),
                                              (tokenizer2_grpc.add_TokenizerServicer_to_server, V2Generate(replica)))
    return server


@dataclass
class Router:
    config: RouterConfig
    pools: Pools
    channel: grpc.aio.Channel

    @property
    def front(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channel)

    @property
    def admin(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self.channel)

    async def health(self) -> int:
        return (await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


@contextlib.asynccontextmanager
async def pd_router(prefill: list[FakeSide], decode: list[FakeSide], **flags):
    """The fakes behind a router wired as `radixmesh serve router --prefill ... --decode ...` wires it."""
    servers = [await _serve_replica(r) for r in (*prefill, *decode)]
    config = RouterConfig(prefill=[r.address for r in prefill], decode=[r.address for r in decode],
                          retry_backoff_s=0.0, seed=0, health_interval_s=0.2, breaker_failures=100, **flags)
    readiness = Readiness()
    pools = Pools.build(config, readiness)
    for role, replicas in (("prefill", prefill), ("decode", decode)):
        for r in replicas:
            pools.fleets[role].add(r.address)
    pools.start()
    front = RouterFront(config, pools)
    router, address, router_health = await _serve(
        (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, front),
        (tokenizer2_grpc.add_TokenizerServicer_to_server, RouterFrontV2(front)),
        (router_pb2_grpc.add_RouterServicer_to_server, RouterAdmin(config, pools)))
    mirror = asyncio.ensure_future(readiness.mirror(lambda status: router_health.set("", status)))
    channel = grpc.aio.insecure_channel(address)
    try:
        for role, replicas in (("prefill", prefill), ("decode", decode)):
            await pools.fleets[role].wait_healthy([r.address for r in replicas], 20)
        pools.track_readiness()
        yield Router(config, pools, channel)
    finally:
        mirror.cancel()
        await channel.close()
        await pools.stop()
        for server in (router, *servers):
            await server.stop(0)


def _request(**fields) -> pb.GenerateTextRequest:
    return pb.GenerateTextRequest(**{"text": "hello pairs", "sampling": cpb.SamplingParams(max_new_tokens=4),
                                     **fields})


async def _generate(stub, request: pb.GenerateTextRequest | None = None) -> tuple[list, Code | None, str]:
    events, code, details = [], None, ""
    try:
        async for event in stub.Generate(request or _request(), timeout=30):
            events.append(event)
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    return events, code, details


def _texts(events) -> list[str]:
    return [e.chunk.text for e in events if e.WhichOneof("event") == "chunk"]


async def _settle(router: Router) -> None:
    """Until every replica's attempt ended (the router ends P's in a task of its own)."""
    for _ in range(200):
        if all(r.in_flight == 0 for _, r in router.pools.replicas()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("attempts still open")


# --- the pair ----------------------------------------------------------------------------------

async def test_both_sides_get_their_part_and_the_client_gets_the_decode_stream():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    async with pd_router([p], [d]) as router:
        events, code, _ = await _generate(router.front, _request(rid="req-1"))
        assert code is None
        assert _texts(events) == ["d0:0", "d0:1"] and events[-1].WhichOneof("event") == "finish"
        (to_p,), (to_d,) = p.requests, d.requests
        assert to_p.rid == to_d.rid == "req-1" and to_p.text == to_d.text == "hello pairs"
        assert to_p.disaggregation.role == PREFILL and to_d.disaggregation.role == DECODE
        assert to_p.disaggregation.room == to_d.disaggregation.room and len(to_p.disaggregation.room) == 32
        assert to_p.disaggregation.bootstrap_address == "" and to_d.disaggregation.bootstrap_address == p.bootstrap
        await _settle(router)
        (pr,), (dr,) = router.pools.prefill.replicas.values(), router.pools.decode.replicas.values()
        assert not p.cancelled.is_set()  # P's stream was read to its end, not cut
        assert (pr.counts["routed"], pr.counts["failures"], dr.counts["routed"]) == (1, 0, 1)
        # A second request is a new room.
        await _generate(router.front)
        assert p.requests[1].disaggregation.room == d.requests[1].disaggregation.room != to_p.disaggregation.room


async def test_v2_generate_relays_the_decode_stream_too():
    from protos.radixmesh.v2 import tokenizer_pb2_grpc as v2

    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    async with pd_router([p], [d]) as router:
        events, code, _ = await _generate(v2.TokenizerStub(router.channel))
        assert code is None
        assert [o.text for e in events for o in e.outputs if o.text] == ["d0:0", "d0:1"]
        assert p.requests[0].disaggregation.room == d.requests[0].disaggregation.room


async def test_the_prefill_pool_is_cache_aware_and_the_bootstrap_is_the_chosen_prefills():
    prefill = [FakeSide(f"p{i}", "prefill", Faults()) for i in range(2)]
    d = FakeSide("d0", "decode", Faults())
    async with pd_router(prefill, [d], cache_threshold=0.1) as router:
        long = "a shared system prompt, long enough to match " * 4
        for i in range(3):
            await _generate(router.front, _request(text=long + str(i)))
        served = [r for r in prefill if r.requests]
        assert len(served) == 1 and len(served[0].requests) == 3  # the prefix stayed on one prefill replica
        assert {q.disaggregation.bootstrap_address for q in d.requests} == {served[0].bootstrap}


async def test_a_prefill_still_streaming_when_the_decode_side_ends_is_cancelled():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    p.hold_after_first = True
    async with pd_router([p], [d]) as router:
        events, code, _ = await _generate(router.front)
        assert code is None and _texts(events) == ["d0:0", "d0:1"]
        await asyncio.wait_for(p.cancelled.wait(), 5)
        await _settle(router)


# --- failures and retries ----------------------------------------------------------------------

@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED])
async def test_a_decode_side_that_could_not_take_it_is_retried_on_another_decode(code):
    faults = Faults(code=code, times=1)
    p = FakeSide("p0", "prefill", Faults())
    decode = [FakeSide(f"d{i}", "decode", faults) for i in range(2)]
    async with pd_router([p], decode, max_retries=2) as router:
        events, got, _ = await _generate(router.front, _request(rid="r"))
        assert got is None
        first, second = faults.calls
        assert first != second  # the pair was retried on the other decode replica
        assert _texts(events) == [f"{second}:0", f"{second}:1"]
        assert [q.rid for q in p.requests] == ["r", "r.1"]  # the whole pair again, under a fresh rid
        rooms = [q.disaggregation.room for q in p.requests]
        assert rooms[0] != rooms[1]
        assert [q.disaggregation.room for r in decode for q in r.requests] in (rooms, rooms[::-1])


async def test_a_prefill_side_that_could_not_take_it_is_avoided_and_the_decode_side_is_cancelled():
    faults = Faults(code=Code.UNAVAILABLE, times=1)
    prefill = [FakeSide(f"p{i}", "prefill", faults) for i in range(2)]
    d = FakeSide("d0", "decode", Faults())  # its first attempt waits for a room that never opens
    async with pd_router(prefill, [d], max_retries=2) as router:
        events, got, _ = await _generate(router.front)
        assert got is None
        first, second = faults.calls
        assert first != second and _texts(events) == ["d0:0", "d0:1"]
        assert len(d.requests) == 2 and d.cancelled.is_set()  # not left waiting for the failed side's KV
        assert [q.disaggregation.bootstrap_address for q in d.requests] == [
            next(r.bootstrap for r in prefill if r.name == name) for name in (first, second)]
        await _settle(router)
        failed = router.pools.prefill.replicas[next(r.address for r in prefill if r.name == first)]
        assert failed.counts["failures"] == 1


async def test_a_deterministic_failure_of_either_side_is_not_retried():
    p = FakeSide("p0", "prefill", Faults(code=Code.INVALID_ARGUMENT))
    d = FakeSide("d0", "decode", Faults())
    async with pd_router([p], [d], max_retries=2) as router:
        events, got, details = await _generate(router.front)
        assert (events, got) == ([], Code.INVALID_ARGUMENT)
        assert "p0 could not take it" in details and "prefill replica" in details
        assert len(p.requests) == 1 and len(d.requests) == 1
        await asyncio.wait_for(d.cancelled.wait(), 5)


async def test_n_above_one_is_refused():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    async with pd_router([p], [d]) as router:
        events, code, details = await _generate(router.front, _request(n=2))
        assert (events, code) == ([], Code.INVALID_ARGUMENT)
        assert details == "n > 1 is not served by disaggregated replicas"
        assert p.requests == [] and d.requests == []
        _, code, _ = await _generate(router.front, _request(n=1))
        assert code is None


async def test_a_client_cancel_reaches_both_sides():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    p.hold_after_first = d.hold = True
    async with pd_router([p], [d]) as router:
        call = router.front.Generate(_request(), timeout=30)
        first = await call.read()
        assert first.chunk.text == "d0:0"
        call.cancel()
        await asyncio.wait_for(asyncio.gather(p.cancelled.wait(), d.cancelled.wait()), 5)
        await _settle(router)


async def test_a_client_cancel_before_the_decode_side_streamed_reaches_both_sides():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    p.hold = True  # the room never opens: D waits
    async with pd_router([p], [d]) as router:
        call = router.front.Generate(_request(), timeout=30)
        while not (p.requests and d.requests):
            await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.wait_for(asyncio.gather(p.cancelled.wait(), d.cancelled.wait()), 5)
        await _settle(router)


# --- admission --------------------------------------------------------------------------------

async def test_a_prefill_without_a_bootstrap_address_is_refused_at_start():
    bad = FakeSide("p-bad", "prefill", Faults(), bootstrap="")
    wrong = FakeSide("p-wrong", "decode", Faults())  # listed as prefill, reports decode
    good = FakeSide("p0", "prefill", Faults())
    d = FakeSide("d0", "decode", Faults())
    async with pd_router([bad, wrong, good], [d]) as router:
        fleet = router.pools.prefill
        statuses = {s.address: s for s in (await router.admin.ListReplicas(router_pb2.ListReplicasRequest())).replicas}
        assert statuses[bad.address].state == statuses[wrong.address].state == "refused"
        assert statuses[good.address].state == "healthy" and statuses[good.address].role == "prefill"
        assert statuses[d.address].role == "decode"
        assert "no bootstrap_address" in fleet.replicas[bad.address].refused
        assert "disaggregation_mode 'decode', not 'prefill'" in fleet.replicas[wrong.address].refused
        await admit_listed(fleet, [bad.address, good.address], router.config)  # one admitted: it serves
        with pytest.raises(RuntimeError, match=f"no prefill replica .*{bad.address} refused: its Info reports no "
                                               "bootstrap_address"):
            await admit_listed(fleet, [bad.address], router.config)
        for _ in range(3):
            await _generate(router.front)
        assert bad.requests == [] and wrong.requests == [] and len(good.requests) == 3


async def test_add_replica_joins_the_pool_its_mode_names_or_is_refused():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    extra = [FakeSide("d1", "decode", Faults()), FakeSide("c0", "", Faults()),
             FakeSide("p-bad", "prefill", Faults(), bootstrap="")]
    servers = [await _serve_replica(r) for r in extra]
    try:
        async with pd_router([p], [d]) as router:
            status = await router.admin.AddReplica(router_pb2.AddReplicaRequest(address=extra[0].address))
            assert status.role == "decode" and extra[0].address in router.pools.decode.replicas
            for replica, why in ((extra[1], "disaggregation_mode '', not 'prefill'"),
                                 (extra[2], "no bootstrap_address")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await router.admin.AddReplica(router_pb2.AddReplicaRequest(address=replica.address))
                assert e.value.code() == Code.FAILED_PRECONDITION
                assert f"replica {replica.address} refused" in e.value.details() and why in e.value.details()
    finally:
        for server in servers:
            await server.stop(0)


async def test_admin_load_ready_and_health_cover_both_pools():
    p, d = FakeSide("p0", "prefill", Faults()), FakeSide("d0", "decode", Faults())
    async with pd_router([p], [d], load_interval_s=0.05) as router:
        listed = await router.admin.ListReplicas(router_pb2.ListReplicasRequest())
        assert [(s.role, s.address) for s in listed.replicas] == [("prefill", p.address), ("decode", d.address)]
        assert listed.policy == "prefill: cache_aware, decode: least_load"
        for _ in range(100):
            load = await router.front.GetLoad(pb.GetLoadRequest())
            if load.num_running == 3:
                break
            await asyncio.sleep(0.02)
        assert load.num_running == 3  # 1 (prefill) + 2 (decode)
        ready = await router.front.Ready(pb.ReadyRequest())
        assert ready.ready and {s.stage for s in ready.stages} == {"prefill replica", "decode replica"}
        info = await router.front.Info(pb.InfoRequest())
        assert info.model_name == "pd-fake" and info.disaggregation_mode == "" and info.bootstrap_address == ""
        # A pair needs both pools: with the only decode replica drained, the router is not ready.
        await router.admin.DrainReplica(router_pb2.DrainReplicaRequest(address=d.address))
        assert await router.health() == NOT_SERVING
        assert not (await router.front.Ready(pb.ReadyRequest())).ready
        _, code, details = await _generate(router.front)
        assert code == Code.UNAVAILABLE and details == "no decode replica is available"
        await router.admin.DrainReplica(router_pb2.DrainReplicaRequest(address=d.address, resume=True))
        assert await router.health() == SERVING


# --- flags ----------------------------------------------------------------------------------------

def test_pool_flags_are_generated_and_checked():
    import argparse

    from services.common.config import config_from_args, flags_from_dataclass

    parser = flags_from_dataclass(RouterConfig, argparse.ArgumentParser(exit_on_error=False))
    config = config_from_args(RouterConfig, parser.parse_args(
        ["--prefill", "a:1", "b:2", "--decode", "c:3", "--decode-policy", "power_of_two"]))
    assert (config.prefill, config.decode, config.disaggregated) == (["a:1", "b:2"], ["c:3"], True)
    assert (config.prefill_policy, config.decode_policy) == ("cache_aware", "power_of_two")
    assert not RouterConfig(replica_addrs=["a:1"]).disaggregated
    assert RouterConfig(prefill_dns="p:50051", decode=["c:3"]).disaggregated
    for bad, message in (({"prefill": ["a:1"]}, "needs both pools: give --decode"),
                         ({"decode": ["a:1"]}, "needs both pools: give --prefill"),
                         ({"prefill": ["a:1"], "decode": ["b:2"], "replica_addrs": ["c:3"]}, "exclude each other"),
                         ({"prefill": ["a:1"], "decode": ["b:2"], "replica_dns": "e:1"}, "exclude each other"),
                         ({"prefill": ["nope"], "decode": ["b:2"]}, "--prefill takes HOST:PORT"),
                         ({"prefill_dns": "x", "decode": ["b:2"]}, "--prefill-dns takes NAME:PORT")):
        with pytest.raises(ValueError, match=message):
            RouterConfig(**bad)
