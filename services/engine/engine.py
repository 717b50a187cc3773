"""The in-process Engine: tokenizer + scheduler + model runner + detokenizer in
one process, driven by one background thread. Tests, benchmarks and the mesh's
services build on it.

The engine thread runs the StepDriver (services/scheduler/driver.py), the loop
the scheduler service runs, against the ModelRunner in this process
(services/engine/runner_link.py). Steps run on a step thread of their own, the
one that built the model; with overlapped scheduling (on unless
--disable-overlap-schedule) the engine thread plans the next step and delivers
the last one's outputs meanwhile, in lockstep it waits.
A failed step ends every open request with an error and rebuilds the scheduler
(the driver's failure policy, as the scheduler service does on worker loss).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from protos.radixmesh.v1 import admin_pb2 as apb
from services.common.hicache_config import HiCacheConfig
from services.common.host_memory import return_freed_memory
from services.common.model_path import resolve_model_path
from services.common.outputs import FinishReason, RequestOutput
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.detokenizer.incremental import IncrementalDetokenizer
from services.engine.runner_admin import RunnerAdmin
from services.engine.runner_link import RunnerLink
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import carry_counters
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.model_admin import ModelAdmin
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.tokenizer.text_tokenizer import TextTokenizer, load_tokenizer
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import Checkpoint, load_checkpoint
from services.worker.admin import adapter_infos
from services.worker.host_pool import attach_tiers
from services.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Flags of an in-process engine: the worker's and the scheduler's, flattened."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)


@dataclass
class _Handle:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    sink: Callable[[RequestOutput], None]
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)


class Engine:
    """generate()/stream() from text, chat messages or token ids; abort(rid)."""

    def __init__(self, model: str | None = None, worker: WorkerConfig | None = None,
                 scheduler: SchedulerConfig | None = None, *, checkpoint: Checkpoint | None = None,
                 tokenizer: TextTokenizer | None = None, hicache: HiCacheConfig | None = None):
        """`checkpoint`/`tokenizer` reuse already loaded ones (tests build many engines);
        `hicache` adds the host tier and the kvstore below the KV pool."""
        worker = worker or WorkerConfig(model=model)
        path = None if checkpoint and tokenizer else resolve_model_path(model or worker.model)
        self.tokenizer: TextTokenizer = tokenizer or load_tokenizer(path)
        sched_cfg = scheduler or SchedulerConfig(max_running_requests=worker.max_requests)
        if sched_cfg.max_running_requests > worker.max_requests:
            raise ValueError("scheduler max_running_requests exceeds the worker's page-table rows")
        hicache = hicache or HiCacheConfig()
        # The step thread builds the model and runs every step (_build_runner).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        try:
            self.runner, self.kvstore, tiers = self._executor.submit(
                self._build_runner, worker, checkpoint, path, hicache, not sched_cfg.disable_radix_cache).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        mc, spec = self.runner.model_config, self.runner.kv_spec
        eos = tuple(sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.limits = ModelLimits(spec.num_pages, spec.page_size, mc.max_position_embeddings, mc.vocab_size, eos,
                                  max_draft_tokens=self.runner.max_draft_tokens,
                                  verify_max_rows=self.runner.verify_rows, max_loras=self.runner.max_loras,
                                  **tiers)
        self._sched_config, self._hicache = sched_cfg, hicache
        self.scheduler = Scheduler(sched_cfg, self.limits, hicache, self.kvstore,
                                   {a.name: a.identity for a in adapter_infos(self.runner)})
        self.model_name = mc.name
        self.overlap = not sched_cfg.disable_overlap_schedule
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, _Handle] = {}
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        hooks = DriverHooks(self._recover, between_steps=self._drain_inbox, deliver=self._deliver)
        self._driver = StepDriver(hooks, self.scheduler, RunnerLink(self.runner, self._executor),
                                  2 if self.overlap else 1, wake=self._wake)
        self._task = self._loop.create_task(self._driver.run())
        self._runner_admin = RunnerAdmin(self.runner, self._executor)
        self.admin = ModelAdmin(lambda: self.scheduler, lambda: self._runner_admin, self._wake.set)
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()

    @staticmethod
    def _build_runner(worker: WorkerConfig, checkpoint: Checkpoint | None, path: str | None, hicache: HiCacheConfig,
                      cache_on: bool):
        """On the step thread, so that its OpenMP team is the process's only one
        (services/worker/omp_team.py): the model, the KV pool and the host tiers are built
        here, where every step runs. Measured: the offline throughput workload 545 → 634
        tok/s on 2 cores (docs/benchmarks.md)."""
        checkpoint = checkpoint or load_checkpoint(path, worker.quantization)  # gguf: no float32 copy of the blocks
        runner = ModelRunner(worker, checkpoint)
        kvstore, tiers = attach_tiers(runner, hicache, checkpoint.source, cache_on=cache_on)
        return runner, kvstore, tiers

    # --- requests -----------------------------------------------------------------
    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None,
                   input_ids: list[int] | None = None) -> list[int]:
        given = sum(x is not None for x in (prompt, messages, input_ids))
        if given != 1:
            raise InvalidRequest("give exactly one of prompt, messages or input_ids")
        if input_ids is not None:
            return list(input_ids)
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def submit(self, ids: list[int], sampling: SamplingParams, sink: Callable[[RequestOutput], None],
               rid: str | None = None, namespace: str = "", adapter: str = "") -> str:
        """Queue a request (under LoRA `adapter`, "" = the base model); `sink` receives its chunks
        from the engine thread. Raises InvalidRequest or QueueFull at once, before anything is queued."""
        self.scheduler.validate(ids, sampling)
        self.scheduler.cache_namespace(namespace, adapter)
        self.scheduler.check_capacity(len(ids))
        rid = rid or uuid.uuid4().hex
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids, stop=list(sampling.stop),
                                       min_tokens=sampling.min_new_tokens)
        self._inbox.put(("submit", _Handle(rid, ids, sampling, sink, detok), seed, namespace, adapter))
        self._notify()
        return rid

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))
        self._notify()

    def _notify(self) -> None:
        """Wake the driver (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: shut down
            pass

    def generate(self, prompt: str | None = None, sampling: SamplingParams | None = None, *,
                 messages: list[dict] | None = None, input_ids: list[int] | None = None,
                 timeout: float | None = None, adapter: str = "") -> RequestOutput:
        """Blocking: the whole completion."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        ids = self.prompt_ids(prompt, messages, input_ids)
        self.submit(ids, sampling or SamplingParams(), q.put, adapter=adapter)
        chunks = []
        while True:
            chunk = q.get(timeout=timeout)
            chunks.append(chunk)
            if chunk.finished:
                return RequestOutput.joined(chunks)

    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                       adapters: list[str] | None = None) -> list[RequestOutput]:
        """Submit all at once (they batch together), wait for all. adapters: one per prompt."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        adapters = adapters or [""] * len(prompts)
        if len(params) != len(prompts) or len(adapters) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params)} sampling params, {len(adapters)} adapters")
        queues = [queue.SimpleQueue() for _ in prompts]
        for ids, sp, q, adapter in zip(prompts, params, queues, adapters):
            self.submit(ids, sp, q.put, adapter=adapter)
        results = []
        for q in queues:
            chunks = [q.get()]
            while not chunks[-1].finished:
                chunks.append(q.get())
            results.append(RequestOutput.joined(chunks))
        return results

    async def stream(self, prompt: str | None = None, sampling: SamplingParams | None = None, *,
                     messages: list[dict] | None = None, input_ids: list[int] | None = None,
                     rid: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async streaming; cancelling the consumer aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        ids = self.prompt_ids(prompt, messages, input_ids)
        rid = self.submit(ids, sampling or SamplingParams(), lambda c: loop.call_soon_threadsafe(q.put_nowait, c),
                          rid=rid)
        finished = False
        try:
            while not finished:
                chunk = await q.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.abort(rid)

    def shutdown(self) -> None:
        """Stop the engine and give its memory back: the threads are joined, then the runner drops
        its weights, KV pool and native objects and freed heap pages go back to the OS
        (tests/integration/test_engine_memory.py holds RSS to it). Idempotent."""
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # shut down already
            pass
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("engine loop did not stop within 30 s; its memory stays held")
            return
        if self.kvstore is not None:
            self.kvstore.close()
        runner, self.runner, self._runner_admin = self.runner, None, None
        if runner is not None:
            runner.close()  # the step thread is gone (the loop's exit shut its executor down)
        return_freed_memory()

    # --- the engine thread ---------------------------------------------------------------
    def _run_loop(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass  # shutdown()
        finally:
            self._driver.link.close()
            self._executor.shutdown(wait=True)
            self._loop.close()

    async def _recover(self, exc: Exception, reason: str) -> tuple[Scheduler, RunnerLink]:
        """The driver's failure policy: every open request ends with the error; a fresh
        scheduler (nothing the old one cached is trusted) drives a runner that forgot
        every request."""
        # after the step running now, if any
        await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.reset)
        old = self.scheduler  # its weights version and adapters are the runner's still
        core = Scheduler(self._sched_config, old.limits, self._hicache, self.kvstore, old.adapters)
        carry_counters(self.scheduler.stats, core.stats)
        self.scheduler = core
        failed, self._handles = self._handles, {}
        for handle in failed.values():
            self._send(handle, RequestOutput(handle.rid, finished=True, finish_reason=FinishReason.ERROR, error=reason))
        return core, RunnerLink(self.runner, self._executor)

    def _drain_inbox(self, core: Scheduler) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "abort":
                core.abort(msg[1])
                continue
            _, handle, seed, namespace, adapter = msg
            try:
                core.submit(handle.rid, handle.prompt_ids, handle.sampling, seed, namespace, adapter)
                self._handles[handle.rid] = handle
            except (InvalidRequest, QueueFull) as exc:
                self._send(handle, RequestOutput(handle.rid, finished=True, finish_reason=FinishReason.ERROR, error=str(exc)))

    # --- model administration (services/scheduler/model_admin.py) --------------------------
    def admin_call(self, call, timeout: float | None = None):
        """Run a ModelAdmin coroutine (self.admin.<method>(...)) on the engine's loop; blocking.
        Returns its ModelState; raises AdminError."""
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(timeout)

    def load_lora_adapter(self, name: str, path: str):
        return self.admin_call(self.admin.load_adapter(apb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)))

    def unload_lora_adapter(self, name: str):
        return self.admin_call(self.admin.unload_adapter(apb.UnloadLoraAdapterRequest(lora_name=name)))

    def update_weights_from_disk(self, path: str, retract: bool = False):
        return self.admin_call(self.admin.update_weights(
            "UpdateWeightsFromDisk", apb.UpdateWeightsFromDiskRequest(model_path=path), retract))

    def update_weights_from_tensor(self, shm_path: str, retract: bool = False):
        return self.admin_call(self.admin.update_weights(
            "UpdateWeightsFromTensor", apb.UpdateWeightsFromTensorRequest(shm_path=shm_path), retract))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weights", backend: str = "gloo", timeout_s: float = 60.0):
        """Join a trainer's group (services/common/weight_sync.WeightBroadcaster); blocks until all joined."""
        return self.admin_call(self._runner_admin.call("InitWeightsUpdateGroup", apb.InitWeightsUpdateGroupRequest(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend, timeout_s=timeout_s)))

    def update_weights_from_distributed(self, metas, group_name: str = "weights", retract: bool = False):
        """metas: (name, dtype name, shape) of the tensors the trainer broadcasts, in its order."""
        request = apb.UpdateWeightsFromDistributedRequest(group_name=group_name, tensors=[
            apb.TensorMeta(name=name, dtype=str(dtype).removeprefix("torch."), shape=list(shape))
            for name, dtype, shape in metas])
        return self.admin_call(self.admin.update_weights("UpdateWeightsFromDistributed", request, retract))

    def flush_kv_writes(self) -> None:
        """Wait until the pages written to the kvstore so far have landed (tests)."""
        if self.kvstore is not None:
            self.kvstore.flush()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.rid)
            if handle is None:
                continue
            chunk = self._to_chunk(handle, out)
            if chunk.finished:
                del self._handles[out.rid]
            self._send(handle, chunk)

    def _send(self, handle: _Handle, chunk: RequestOutput) -> None:
        try:
            handle.sink(chunk)
        except Exception:  # a consumer that is gone (its event loop closed) loses its request
            log.warning("request %s: its consumer failed; aborting it", handle.rid, exc_info=True)
            self._handles.pop(handle.rid, None)
            if not chunk.finished:
                self.scheduler.abort(handle.rid)

    def _to_chunk(self, handle: _Handle, out: RequestOutput) -> RequestOutput:
        text, finished, reason, matched = "", out.finished, out.finish_reason, out.matched_stop
        ids = out.token_ids
        if ids:
            # A matched stop token is the step's last and is not text; the step's other tokens are
            # (a speculative or jump-forward step can end in EOS after several of them).
            stop_token = finished and reason is FinishReason.STOP and isinstance(matched, int) and matched in ids[-1:]
            visible = ids[:-1] if stop_token else ids
            delta = handle.detok.push(visible)
            text = delta.text
            if delta.stopped and not finished:
                self.scheduler.finish_early(out.rid, FinishReason.STOP, delta.matched_stop)
                finished, reason, matched = True, FinishReason.STOP, delta.matched_stop
            elif delta.stopped:
                reason, matched = FinishReason.STOP, delta.matched_stop
        if finished and not (reason is FinishReason.STOP and isinstance(matched, str)):
            text += handle.detok.flush()
        handle.token_ids.extend(ids)
        return replace(out, text=text, finished=finished, finish_reason=reason, matched_stop=matched)

