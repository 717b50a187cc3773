"""radixmesh.v1.ModelAdmin at the router: every call goes to every replica that may take work
(of every pool, in a disaggregated fleet: a pair's two sides must run the same weights).

The replicas are called at once (InitWeightsUpdateGroup must be: each blocks until all ranks
of the group joined), replica i of the fleet in address order getting rank rank_offset + i.
The answer holds one ModelState per replica (`replicas`); the top-level fields are the
first replica's. When a replica fails, the call fails with its status and the replica named;
the others' changes stand (an adapter loaded on two of three replicas stays loaded there:
repeat the call, a load of the same adapter is idempotent; a weight update is per replica).
"""
from __future__ import annotations

import asyncio

import grpc

from protos.radixmesh.v1 import admin_pb2 as apb
from protos.radixmesh.v1 import admin_pb2_grpc
from services.common.admin_forward import TIMEOUT_S, serve_every_method
from services.router.fleet import Fleet, Replica
from services.router.pools import Pools


class FanOutAdmin(admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, fleet: Fleet | Pools) -> None:
        self.pools = Pools.of(fleet)

    async def fan_out(self, method: str, request, context: grpc.aio.ServicerContext) -> apb.ModelState:
        replicas = sorted((r for _, r in self.pools.replicas() if r.routable), key=lambda r: r.address)
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is available")
        answers = await asyncio.gather(*(self._call(r, i, method, request) for i, r in enumerate(replicas)),
                                       return_exceptions=True)
        for replica, answer in zip(replicas, answers):
            if isinstance(answer, grpc.aio.AioRpcError):
                await context.abort(answer.code(), f"replica {replica.address}: {answer.details()}")
            if isinstance(answer, BaseException):
                raise answer
        state = apb.ModelState()
        state.CopyFrom(answers[0])
        for replica, answer in zip(replicas, answers):
            answer.address = replica.address
            state.replicas.append(answer)
        return state

    @staticmethod
    async def _call(replica: Replica, index: int, method: str, request) -> apb.ModelState:
        if method == "InitWeightsUpdateGroup":
            mine = apb.InitWeightsUpdateGroupRequest()
            mine.CopyFrom(request)
            mine.rank_offset = request.rank_offset + index
            request = mine
        stub = admin_pb2_grpc.ModelAdminStub(replica.channel)
        return await getattr(stub, method)(request, timeout=TIMEOUT_S)


serve_every_method(FanOutAdmin, "fan_out")
