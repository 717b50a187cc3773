"""radixmesh.v1.ModelAdmin at a stage that only passes it on (the tokenizer, to its scheduler):
every method forwards the request as it is and the answer, or the error's status, back."""
from __future__ import annotations

from typing import Callable

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc

METHODS = ("GetModelState", "LoadLoraAdapter", "UnloadLoraAdapter", "UpdateWeightsFromDisk",
           "UpdateWeightsFromTensor", "InitWeightsUpdateGroup", "UpdateWeightsFromDistributed",
           "ExpertDistribution", "FlushCache")
TIMEOUT_S = 900.0  # a weight update waits for running requests to finish first


class ForwardingAdmin(admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, channel: Callable[[], grpc.aio.Channel], where: str) -> None:
        """channel: opens one to the next stage (its ModelAdmin), on the first call (on the
        serving event loop); where: its name in error messages."""
        self._channel, self._stub, self._where = channel, None, where

    async def forward(self, method: str, request, context: grpc.aio.ServicerContext):
        if self._stub is None:
            self._stub = admin_pb2_grpc.ModelAdminStub(self._channel())
        try:
            return await getattr(self._stub, method)(request, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            detail = e.details() or code.name
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                detail = f"{self._where}: {detail}"
            await context.abort(code, detail)


def carry_model_state(info, state) -> None:
    """Keep a WorkerInfo (what GetInfo answers) true to a ModelState an admin call returned."""
    if info is not None:
        del info.adapters[:]
        info.adapters.extend(state.adapters)
        info.weights_version = state.weights_version


def serve_every_method(cls: type, handler: str) -> type:
    """Give a ModelAdmin servicer class one method per RPC, each calling
    `self.<handler>(method name, request, context)`: the stages differ only in that handler."""
    def rpc(method: str):
        async def call(self, request, context):
            return await getattr(self, handler)(method, request, context)
        call.__name__ = method
        return call

    for method in METHODS:
        setattr(cls, method, rpc(method))
    return cls


serve_every_method(ForwardingAdmin, "forward")
