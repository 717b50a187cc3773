"""The worker's radixmesh.v1.ModelAdmin service: a thin shell around services/worker/admin.py.

Calls run on an admin thread of their own, under the service's model lock, which every step
holds while it runs: an adapter load or a weight swap happens between two steps, never under
a forward. InitWeightsUpdateGroup takes no lock (joining the group waits for the trainer and
touches no weights).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos.radixmesh.v1 import admin_pb2_grpc
from services.common.admin_error import AdminError
from services.common.admin_forward import serve_every_method
from services.worker.admin import WorkerAdmin

UNLOCKED = {"InitWeightsUpdateGroup"}


class WorkerAdminService(admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, service) -> None:  # the WorkerService
        self._service = service
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="worker-admin")
        self._group_executor = ThreadPoolExecutor(1, thread_name_prefix="worker-group")

    async def handle(self, method: str, request, context: grpc.aio.ServicerContext):
        runner = self._service.runner
        if runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        admin = WorkerAdmin(runner)
        executor = self._group_executor if method in UNLOCKED else self._executor
        try:
            state = await asyncio.get_running_loop().run_in_executor(executor, self._run, admin, method, request)
        except AdminError as e:
            await context.abort(e.status_code, e.message)
        self._service.model_changed(state)
        return state

    def _run(self, admin: WorkerAdmin, method: str, request):
        if method in UNLOCKED:
            return admin.handle(method, request)
        with self._service.model_lock:
            return admin.handle(method, request)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._group_executor.shutdown(wait=False, cancel_futures=True)


serve_every_method(WorkerAdminService, "handle")
