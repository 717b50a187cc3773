"""The scheduler's WorkerAdminLink to a ModelRunner in this process (the Engine's).

Calls run on the Engine's step thread, queued behind the plans sent before them, so they
happen between two steps.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from protos.radixmesh.v1 import admin_pb2 as apb
from services.worker.admin import WorkerAdmin


class RunnerAdmin:
    def __init__(self, runner, executor: ThreadPoolExecutor) -> None:
        self._admin, self._executor = WorkerAdmin(runner), executor

    async def call(self, method: str, request) -> apb.ModelState:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._admin.handle, method, request)
