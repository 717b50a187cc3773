"""The worker's share of model administration (radixmesh.v1.ModelAdmin), transport-free.

`WorkerAdmin.handle(method, request)` runs one call on the runner and answers the worker's
ModelState. It must run between two steps, on the thread that runs them or under the lock
they hold (the worker service's model lock; the Engine's step thread): weights and adapter
slots never change under a running forward. What the caches must forget is the scheduler's
business (services/scheduler/model_admin.py); calling a worker directly while a scheduler
drives it leaves that scheduler's caches stale.

Errors: AdminError with a code; a failed weight update leaves the old weights serving
(services/worker/weights validates everything before it swaps).
"""
from __future__ import annotations

import time

from protos.radixmesh.v1 import admin_pb2 as apb
from protos.radixmesh.v1 import worker_pb2 as wpb
from services.common import expert_distribution
from services.common.admin_error import FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, AdminError
from services.worker.lora.adapter import AdapterError
from services.worker.weights.errors import WeightUpdateError


class WorkerAdmin:
    def __init__(self, runner) -> None:  # a ModelRunner
        self.runner = runner

    def handle(self, method: str, request) -> apb.ModelState:
        state = getattr(self, f"_{method}")(request)
        return state if state is not None else self.state()

    def state(self, seconds: float = 0.0) -> apb.ModelState:
        r = self.runner
        return apb.ModelState(model=r.model_config.name, weights_version=str(r.weights_version),
                              adapters=adapter_infos(r), max_loras=r.max_loras, seconds=seconds)

    # --- adapters ------------------------------------------------------------------
    def _GetModelState(self, request: apb.GetModelStateRequest) -> None:
        return None

    def _loras(self):
        if self.runner.loras is None:
            raise AdminError(FAILED_PRECONDITION, "this worker serves no LoRA adapters (--max-loras 0)")
        return self.runner.loras

    def _LoadLoraAdapter(self, request: apb.LoadLoraAdapterRequest) -> apb.ModelState:
        t0 = time.perf_counter()
        try:
            self._loras().load(request.lora_name, request.lora_path)
        except AdapterError as e:
            raise AdminError(INVALID_ARGUMENT, str(e)) from None
        return self.state(time.perf_counter() - t0)

    def _UnloadLoraAdapter(self, request: apb.UnloadLoraAdapterRequest) -> None:
        loras = self._loras()
        if request.lora_name not in loras:
            raise AdminError(NOT_FOUND, f"no LoRA adapter named {request.lora_name!r} is loaded")
        try:
            loras.unload(request.lora_name)
        except AdapterError as e:  # in use by a live request
            raise AdminError(FAILED_PRECONDITION, str(e)) from None

    # --- weights -------------------------------------------------------------------
    def _UpdateWeightsFromDisk(self, request: apb.UpdateWeightsFromDiskRequest) -> apb.ModelState:
        return self._updated(lambda: self.runner.update_weights_from_disk(request.model_path))

    def _UpdateWeightsFromTensor(self, request: apb.UpdateWeightsFromTensorRequest) -> apb.ModelState:
        return self._updated(lambda: self.runner.update_weights_from_tensor(shm_path=request.shm_path))

    def _InitWeightsUpdateGroup(self, request: apb.InitWeightsUpdateGroupRequest) -> None:
        try:
            self.runner.init_weights_update_group(
                request.master_address, request.master_port, request.rank_offset, request.world_size,
                request.group_name or "weights", request.backend or "gloo", request.timeout_s or 60.0)
        except WeightUpdateError as e:
            raise AdminError(INVALID_ARGUMENT, str(e)) from None

    def _UpdateWeightsFromDistributed(self, request: apb.UpdateWeightsFromDistributedRequest) -> apb.ModelState:
        names = [t.name for t in request.tensors]
        dtypes = [t.dtype for t in request.tensors]
        shapes = [list(t.shape) for t in request.tensors]
        return self._updated(lambda: self.runner.update_weights_from_distributed(
            names, dtypes, shapes, request.group_name or "weights"))

    def _FlushCache(self, request) -> None:
        """The caches are the scheduler's (its radix tree and KV tiers); the worker holds none to drop."""
        raise AdminError(FAILED_PRECONDITION, "the worker keeps no prefix cache: flush through its scheduler "
                         "(ModelAdmin.FlushCache there, or the gateway's POST /flush_cache)")

    # --- the expert distribution recorder ------------------------------------------------
    def _ExpertDistribution(self, request: apb.ExpertDistributionRequest) -> apb.ModelState:
        """Start, stop or read the recorder (services/worker/model/expert_load.py); every action
        answers the recording as it then stands (a start: zeros, recording)."""
        recorder = self.runner.expert_load
        if recorder is None:
            raise AdminError(FAILED_PRECONDITION, f"the model {self.runner.model_config.name} has no experts "
                             "(not a mixture of experts): there is no expert distribution to record")
        action = request.action
        if action == apb.EXPERT_DISTRIBUTION_START:
            recorder.start()
        elif action == apb.EXPERT_DISTRIBUTION_STOP:
            recorder.stop()
        elif action != apb.EXPERT_DISTRIBUTION_DUMP:
            raise AdminError(INVALID_ARGUMENT, f"unknown expert distribution action {action}: start, stop or dump")
        try:
            dump = recorder.dump()
        except ValueError as e:  # nothing was recorded yet
            raise AdminError(FAILED_PRECONDITION, str(e)) from None
        state = self.state()
        state.expert_distribution.CopyFrom(expert_distribution.to_proto(dump))
        return state

    def _updated(self, update) -> apb.ModelState:
        try:
            report = update()
        except WeightUpdateError as e:
            raise AdminError(INVALID_ARGUMENT, f"{e} (the old weights keep serving)") from None
        state = self.state()
        state.update.CopyFrom(apb.WeightUpdateReport(
            path=report.path, bytes=report.bytes, load_seconds=report.load_seconds,
            swap_seconds=report.validate_seconds + report.swap_seconds))
        return state


def adapter_infos(runner) -> list[wpb.AdapterInfo]:
    loras = runner.loras
    if loras is None:
        return []
    return [wpb.AdapterInfo(name=a.name, identity=a.identity, rank=a.rank, target_modules=list(a.target_modules),
                            path=a.path, resident=a.resident) for a in loras.infos()]
