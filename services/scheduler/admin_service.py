"""The scheduler's radixmesh.v1.ModelAdmin service: a thin shell around services/scheduler/model_admin.py."""
from __future__ import annotations

import grpc

from protos.radixmesh.v1 import admin_pb2 as apb
from protos.radixmesh.v1 import admin_pb2_grpc
from services.common.admin_error import FAILED_PRECONDITION, UNAVAILABLE, AdminError
from services.scheduler.model_admin import GrpcWorkerAdmin, ModelAdmin

_RETRACT = apb.RUNNING_REQUESTS_RETRACT


class SchedulerAdminService(admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, service) -> None:  # the SchedulerService
        self._service = service
        self._admin = ModelAdmin(self._core, self._link, service._wake.set)
        self._worker_admin: GrpcWorkerAdmin | None = None

    def _core(self):
        if self._service.core is None or not self._service.connected:
            raise AdminError(UNAVAILABLE, "the scheduler has no worker connected")
        return self._service.core

    def _link(self) -> GrpcWorkerAdmin:
        self._core()
        if self._worker_admin is None:
            self._worker_admin = GrpcWorkerAdmin(self._service._channel)
        return self._worker_admin

    async def _run(self, context: grpc.aio.ServicerContext, call) -> apb.ModelState:
        try:
            state = await call
        except AdminError as e:
            await context.abort(e.status_code, e.message)
        self._service.model_changed(state)
        return state

    async def GetModelState(self, request, context):
        return await self._run(context, self._admin.state())

    async def LoadLoraAdapter(self, request, context):
        return await self._run(context, self._admin.load_adapter(request))

    async def UnloadLoraAdapter(self, request, context):
        return await self._run(context, self._admin.unload_adapter(request))

    async def UpdateWeightsFromDisk(self, request, context):
        return await self._run(context, self._admin.update_weights(
            "UpdateWeightsFromDisk", request, request.running == _RETRACT))

    async def UpdateWeightsFromTensor(self, request, context):
        return await self._run(context, self._admin.update_weights(
            "UpdateWeightsFromTensor", request, request.running == _RETRACT))

    async def InitWeightsUpdateGroup(self, request, context):
        return await self._passed_on("InitWeightsUpdateGroup", request, context)

    async def ExpertDistribution(self, request, context):
        # The recorder touches no weights and no cache: admission goes on, the worker runs it
        # between two steps under its model lock.
        return await self._passed_on("ExpertDistribution", request, context)

    async def FlushCache(self, request, context):
        """The scheduler's own FlushCache, with its refusal as FAILED_PRECONDITION."""
        try:
            pages = flush(self._core())
        except AdminError as e:
            await context.abort(e.status_code, e.message)
        state = await self._run(context, self._admin.state())
        state.flushed_pages = pages
        return state

    async def _passed_on(self, method: str, request, context: grpc.aio.ServicerContext) -> apb.ModelState:
        """Straight to the worker: nothing the scheduler caches changes."""
        try:
            return await self._link().call(method, request)
        except AdminError as e:
            await context.abort(e.status_code, e.message)

    async def UpdateWeightsFromDistributed(self, request, context):
        return await self._run(context, self._admin.update_weights(
            "UpdateWeightsFromDistributed", request, request.running == _RETRACT))


def flush(core) -> int:
    """Drop every cached prefix of a scheduler core (both tiers); the pages dropped. Raises
    AdminError(FAILED_PRECONDITION), changing nothing, while requests run or wait."""
    cache = core.kv.cache
    pages = cache.cached_pages + cache.host_pages
    running, waiting = len(core.running), len(core.waiting)
    if not core.flush_cache():
        raise AdminError(FAILED_PRECONDITION, f"cannot flush the prefix cache: {running} running and {waiting} "
                         "waiting requests hold or need it (retry when the scheduler is idle)")
    return pages
