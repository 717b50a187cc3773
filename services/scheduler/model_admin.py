"""Model administration at the scheduler: LoRA adapters and weight updates, kept true to the caches.

The worker does the work (services/worker/admin.py); the scheduler decides when, and what the
caches must forget:

- **Adapters.** A load returns the worker's adapter list, which the core takes
  (`Scheduler.set_adapters`): from then on requests may name the adapter, and its KV lives in
  a namespace of its own (the adapter's identity, a digest of its weights). An unload is
  refused while queued or running requests use the adapter.
- **Weight updates.** One at a time. Admission pauses; running requests finish on the old
  weights, or are retracted to re-run on the new ones (`RUNNING_REQUESTS_RETRACT`). Once
  nothing runs and no step is in flight, the worker swaps its weights between two steps; then
  every cached page (device and host tier) is dropped and pages are keyed by the new version,
  so the kvstore's old pages never match again. A failed update changes nothing: the worker
  keeps its old weights (it validates before it swaps) and admission resumes.

`WorkerAdminLink` is how the worker is reached: over gRPC from the scheduler service
(GrpcWorkerAdmin), or in process from the Engine (services/engine/runner_admin.py).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

import grpc

from protos.radixmesh.v1 import admin_pb2 as apb
from protos.radixmesh.v1 import admin_pb2_grpc
from services.common.admin_error import FAILED_PRECONDITION, NOT_FOUND, AdminError
from services.common.admin_forward import TIMEOUT_S
from services.scheduler.scheduler import Scheduler

QUIESCE_POLL_S = 0.005


class WorkerAdminLink(Protocol):
    async def call(self, method: str, request) -> apb.ModelState:
        """Run ModelAdmin `method` (e.g. "LoadLoraAdapter") at the worker, between its steps.
        Raises AdminError."""


class GrpcWorkerAdmin:
    """The worker's ModelAdmin service over the scheduler's channel to it."""

    def __init__(self, channel, timeout_s: float = TIMEOUT_S) -> None:
        self._stub, self._timeout_s = admin_pb2_grpc.ModelAdminStub(channel), timeout_s

    async def call(self, method: str, request) -> apb.ModelState:
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise AdminError.from_rpc_error(exc, "worker") from None


def adapter_identities(state: apb.ModelState) -> dict[str, str]:
    return {a.name: a.identity for a in state.adapters}


class ModelAdmin:
    def __init__(self, core: Callable[[], Scheduler], link: Callable[[], WorkerAdminLink],
                 wake: Callable[[], None]) -> None:
        """core/link: the current scheduler core and worker link (both are replaced when the
        worker is lost); wake: nudges the step loop (new work, or admission resumed)."""
        self._core, self._link, self._wake = core, link, wake
        self._updating = asyncio.Lock()

    async def state(self) -> apb.ModelState:
        state = await self._link().call("GetModelState", apb.GetModelStateRequest())
        self._core().set_adapters(adapter_identities(state))
        return state

    async def load_adapter(self, request: apb.LoadLoraAdapterRequest) -> apb.ModelState:
        state = await self._link().call("LoadLoraAdapter", request)
        self._core().set_adapters(adapter_identities(state))
        return state

    async def unload_adapter(self, request: apb.UnloadLoraAdapterRequest) -> apb.ModelState:
        core, name = self._core(), request.lora_name
        if name not in core.adapters:
            raise AdminError(NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
        users = core.adapter_users(name)
        if users:
            raise AdminError(FAILED_PRECONDITION, f"LoRA adapter {name!r} is in use by {users} requests")
        state = await self._link().call("UnloadLoraAdapter", request)
        core.set_adapters(adapter_identities(state))
        return state

    async def update_weights(self, method: str, request, retract: bool) -> apb.ModelState:
        """Pause admission, get the running requests out of the way, have the worker run
        `method` (UpdateWeightsFrom{Disk,Tensor,Distributed}), then flush every cache tier
        keyed on the old version. The report's times cover each phase."""
        if self._updating.locked():
            raise AdminError(FAILED_PRECONDITION, "another weight update is under way")
        async with self._updating:
            t0 = time.monotonic()
            core = self._core()
            core.admission_paused = True
            try:
                retracted = core.retract_all() if retract else 0
                self._wake()
                await self._quiesced()
                paused = time.monotonic()
                state = await self._link().call(method, request)
                await self._quiesced()  # a release-only plan may have gone out meanwhile
                t1 = time.monotonic()
                dropped = self._core().weights_updated(state.weights_version)
                done = time.monotonic()
            finally:
                self._core().admission_paused = False
                self._wake()
            report = state.update
            report.pause_seconds, report.flush_seconds = paused - t0, done - t1
            report.flushed_pages, report.retracted, report.total_seconds = dropped, retracted, done - t0
            return state

    async def _quiesced(self) -> None:
        """Until no request runs and no step is in flight (the loop keeps stepping meanwhile)."""
        while True:
            core = self._core()
            if not core.running and not core.steps_in_flight:
                return
            await asyncio.sleep(QUIESCE_POLL_S)
