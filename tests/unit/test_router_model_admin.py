"""The router's share of model administration, over real gRPC on loopback: ModelAdmin calls fan out
to every routable replica (replica i of the fleet gets rank rank_offset + i for a weights group, a
replica's error names it), and a LoRA adapter's requests go to the replicas that report it resident."""
from __future__ import annotations

import grpc
import pytest

from protos.radixmesh.v1 import admin_pb2 as apb
from protos.radixmesh.v1 import admin_pb2_grpc
from services.router.admin_fanout import FanOutAdmin
from services.router.config import RouterConfig
from services.router.fleet import Fleet


class FakeReplicaAdmin(admin_pb2_grpc.ModelAdminServicer):
    """A replica's ModelAdmin that records what it was asked."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail, self.calls = name, fail, []

    async def LoadLoraAdapter(self, request, context):
        self.calls.append(("load", request.lora_name))
        if self.fail:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank 128 is above --max-lora-rank 64")
        return apb.ModelState(model=self.name, weights_version="3")

    async def InitWeightsUpdateGroup(self, request, context):
        self.calls.append(("init", request.rank_offset))
        return apb.ModelState(model=self.name)


class Context:
    """The servicer context FanOutAdmin aborts on."""

    async def abort(self, code, details):
        raise grpc.RpcError(f"{code.name}: {details}")


@pytest.fixture
async def replicas():
    servers, fakes = [], []
    for i, fail in enumerate([False, False, True]):
        server = grpc.aio.server()
        fake = FakeReplicaAdmin(f"replica-{i}", fail)
        admin_pb2_grpc.add_ModelAdminServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        fakes.append((f"127.0.0.1:{port}", fake))
    yield fakes
    for server in servers:
        await server.stop(None)


def fleet_of(addresses: list[str]) -> Fleet:
    fleet = Fleet(RouterConfig())
    for address in addresses:
        fleet.add(address).healthy = True
    return fleet


async def test_calls_reach_every_routable_replica_with_its_own_rank(replicas):
    (a, fa), (b, fb), _ = replicas
    fleet = fleet_of([b, a])
    state = await FanOutAdmin(fleet).LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name="sql"), Context())
    assert sorted(s.address for s in state.replicas) == sorted([a, b])
    assert fa.calls == fb.calls == [("load", "sql")] and state.weights_version == "3"
    await FanOutAdmin(fleet).InitWeightsUpdateGroup(apb.InitWeightsUpdateGroupRequest(rank_offset=1), Context())
    by_address = sorted([(a, fa), (b, fb)])
    assert [fake.calls[-1] for _, fake in by_address] == [("init", 1), ("init", 2)]
    fleet.replicas[a].draining = True  # not routable: not called
    await FanOutAdmin(fleet).LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name="chat"), Context())
    assert ("load", "chat") in fb.calls and ("load", "chat") not in fa.calls


async def test_a_replica_that_refuses_fails_the_call_naming_it(replicas):
    (a, _), _, (c, fc) = replicas
    with pytest.raises(grpc.RpcError, match=f"INVALID_ARGUMENT: replica {c}: rank 128"):
        await FanOutAdmin(fleet_of([a, c])).LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name="big"), Context())
    assert fc.calls == [("load", "big")]


async def test_an_adapters_requests_prefer_replicas_with_it_resident():
    fleet = fleet_of(["r0:1", "r1:1", "r2:1"])
    fleet.replicas["r2:1"].report.resident_adapters.append("sql")
    assert {fleet.choose(f"k{i}", set(), "sql")[0].address for i in range(6)} == {"r2:1"}
    fleet.replicas["r2:1"].draining = True  # no routable replica has it: any replica
    assert fleet.choose("k", set(), "sql")[0].address in {"r0:1", "r1:1"}
    assert {fleet.choose(f"k{i}", set())[0].address for i in range(9)} <= {"r0:1", "r1:1"}
