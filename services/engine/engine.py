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
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from protos.radixmesh.v1 import admin_pb2 as apb
from services.common import expert_distribution
from services.common.hicache_config import HiCacheConfig
from services.common.host_memory import return_freed_memory
from services.common.model_path import resolve_model_path
from services.common.outputs import FinishReason, RequestOutput
from services.common.request_limits import check_request_limits
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.common.text_options import TextOptions
from services.detokenizer.sequence_text import SequenceText
from services.engine.runner_admin import RunnerAdmin
from services.engine.dp_lanes import DpLanes
from services.engine.runner_link import RunnerLink, dp_step
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import carry_counters
from services.scheduler.core_factory import build_core, fit_config
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.admin_service import flush
from services.scheduler.model_admin import ModelAdmin
from services.scheduler.open_requests import OpenRequests
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import Scheduler
from services.tokenizer.text_tokenizer import TextTokenizer, load_tokenizer
from services.worker.config import WorkerConfig
from services.worker.host_pool import attach_tiers
from services.worker.info import worker_info
from services.worker.loader.checkpoint import Checkpoint
from services.worker.group.dp_rounds import DpRounds
from services.worker.group.leader import create_runner, load_rank_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Flags of an in-process engine: the worker's and the scheduler's, flattened."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)


class EngineBroken(RuntimeError):
    """The engine's worker failed and could not be reset (a worker group lost a rank): every
    request still open ended with the error; new ones are refused with it."""


@dataclass
class _Handle:
    """A submitted request until the engine thread queues it: then its owner in OpenRequests."""
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    sink: Callable[[RequestOutput], None]
    texts: list[SequenceText]  # one per sequence
    namespace: str = ""
    adapter: str = ""


class Engine:
    """generate()/stream() from text, chat messages or token ids; abort(rid)."""

    def __init__(self, model: str | None = None, worker: WorkerConfig | None = None,
                 scheduler: SchedulerConfig | None = None, *, checkpoint: Checkpoint | None = None,
                 tokenizer: TextTokenizer | None = None, hicache: HiCacheConfig | None = None,
                 _dp_lane: tuple[Engine, int] | None = None):
        """`checkpoint`/`tokenizer` reuse already loaded ones (tests build many engines);
        `hicache` adds the host tier and the kvstore below the KV pool. With
        --enable-dp-attention the engine is data-parallel rank 0's scheduler, and builds one more
        engine (_dp_lane: this one and its rank) per other rank, sharing its runner and step
        thread; submit spreads requests over them (dp_lanes.py)."""
        worker = worker or WorkerConfig(model=model)
        if worker.disaggregation_mode != "null":
            raise ValueError(f"--disaggregation-mode {worker.disaggregation_mode}: disaggregation pairs replicas of "
                             "the mesh (radixmesh up --prefill N --decode M); the in-process Engine is one replica")
        sched_cfg = scheduler or SchedulerConfig(max_running_requests=worker.max_requests)
        hicache = hicache or HiCacheConfig()
        self._front, self.dp_rank = _dp_lane or (None, 0)
        if self._front is None:
            path = None if checkpoint and tokenizer else resolve_model_path(model or worker.model)
            self.tokenizer: TextTokenizer = tokenizer or load_tokenizer(path)
            # The step thread builds the model and runs every step (_build_runner).
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
            try:
                self.runner, self.kvstore, self._tiers = self._executor.submit(
                    self._build_runner, worker, checkpoint, path, hicache, not sched_cfg.disable_radix_cache).result()
            except BaseException:
                self._executor.shutdown(wait=False)
                raise
            self._rounds = DpRounds(self.runner, worker.dp_size) if worker.enable_dp_attention else None
        else:  # another data-parallel rank's scheduler, on the first engine's runner and step thread
            front = self._front
            self.tokenizer, self._executor, self.runner = front.tokenizer, front._executor, front.runner
            self.kvstore, self._tiers, self._rounds = None, None, front._rounds
        mc = self.runner.model_config
        self._eos = tuple(sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        # The scheduler is built as the scheduler service builds it, from the worker's description
        # of itself (services/scheduler/core_factory.py).
        self._sched_config, self._hicache = fit_config(sched_cfg, self._worker_info()), hicache
        self.scheduler = build_core(self._sched_config, self._worker_info(), hicache, self.kvstore)
        self.model_name = mc.name
        self.overlap = not self._sched_config.disable_overlap_schedule
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: str | None = None  # why the driver stopped for good (a worker group that broke)
        self._requests = OpenRequests()
        self._early: list[tuple[str, str]] = []  # (core rid, matched stop string) to end between steps
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        hooks = DriverHooks(self._recover, between_steps=self._drain_inbox, deliver=self._deliver)
        self._driver = StepDriver(hooks, self.scheduler, self._link(), 2 if self.overlap else 1, wake=self._wake)
        self._task = self._loop.create_task(self._driver.run())
        self._runner_admin = RunnerAdmin(self.runner, self._executor)
        self.admin = ModelAdmin(lambda: self.scheduler, lambda: self._runner_admin, self._wake.set)
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()
        self._lanes: DpLanes | None = None
        if self._rounds is not None and self._front is None:
            try:
                self._lanes = DpLanes(self, [Engine(worker=worker, scheduler=scheduler, hicache=hicache,
                                                    _dp_lane=(self, r)) for r in range(1, worker.dp_size)])
            except BaseException:
                self.shutdown()
                raise

    def _link(self):
        """The scheduler's link to the runner: direct, or through the data-parallel rounds."""
        step = None if self._rounds is None else dp_step(self._rounds, self.dp_rank)
        return RunnerLink(self.runner, self._executor, step)

    @staticmethod
    def _build_runner(worker: WorkerConfig, checkpoint: Checkpoint | None, path: str | None, hicache: HiCacheConfig,
                      cache_on: bool):
        """On the step thread, so that its OpenMP team is the process's only one
        (services/worker/omp_team.py): the model, the KV pool and the host tiers are built
        here, where every step runs. Measured: the offline throughput workload 545 → 634
        tok/s on 2 cores (docs/benchmarks.md)."""
        # gguf: no float32 copy of the blocks; a group's leader: its own part only
        checkpoint = checkpoint or load_rank_checkpoint(worker, path)
        runner = create_runner(worker, checkpoint, hicache)  # a worker group's leader with --tp-size > 1
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

    @property
    def limits(self):
        """The model's and the KV pool's limits (services/scheduler/scheduler.ModelLimits)."""
        return self.scheduler.limits

    def _worker_info(self):
        """The runner as a worker describes itself to its scheduler (its weights and adapters now)."""
        return worker_info(self.runner, self._eos, self._tiers, self._hicache_addr())

    def _hicache_addr(self) -> str | None:
        return getattr(getattr(self, "_hicache", None), "kvstore_addr", None)

    def submit(self, ids: list[int], sampling: SamplingParams, sink: Callable[[RequestOutput], None],
               rid: str | None = None, namespace: str = "", adapter: str = "", n: int = 1,
               skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> str:
        """Queue a request of `n` sequences (under LoRA `adapter`, "" = the base model); `sink`
        receives their outputs (RequestOutput.index: the sequence) from the engine thread, with
        their text. Raises InvalidRequest or QueueFull at once, before anything is queued."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        rid = rid or uuid.uuid4().hex
        if self._lanes is not None:  # rank 0's engine: the lane the cache-aware choice picks takes it
            lane, sink = self._lanes.pick(rid, ids, sink, n)
            if lane is not self:
                return lane.submit(ids, sampling, sink, rid, namespace, adapter, n, skip_special_tokens,
                                   include_stop_str_in_output)
        check_request_limits(sampling, n, rid)
        self.scheduler.validate(ids, sampling)
        self.scheduler.cache_namespace(namespace, adapter)
        self.scheduler.check_capacity(len(ids) * n)
        options = TextOptions.for_prompt(ids, sampling.stop, sampling.min_new_tokens, skip_special_tokens,
                                         include_stop_str_in_output)
        texts = [SequenceText(self.tokenizer, options, self.tokenizer.token_text) for _ in range(n)]
        self._inbox.put(("submit", _Handle(rid, ids, sampling, sink, texts, namespace, adapter)))
        if self._broken is not None:  # it broke while this one was being queued: no driver will take it
            self._fail_inbox()
        self._notify()
        return rid

    def abort(self, rid: str) -> None:
        lane = self._lanes.lane_of(rid) if self._lanes is not None else self
        if lane is not self:
            lane.abort(rid)
            return
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
        return self.generate_n(prompt, sampling, 1, messages=messages, input_ids=input_ids, timeout=timeout,
                               adapter=adapter)[0]

    def generate_n(self, prompt: str | None = None, sampling: SamplingParams | None = None, n: int = 1, *,
                   messages: list[dict] | None = None, input_ids: list[int] | None = None,
                   timeout: float | None = None, adapter: str = "", **text_flags) -> list[RequestOutput]:
        """Blocking: the `n` sequences of one request, by index (seeds seed, seed+1, ...).
        text_flags: skip_special_tokens, include_stop_str_in_output."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        ids = self.prompt_ids(prompt, messages, input_ids)
        self.submit(ids, sampling or SamplingParams(), q.put, adapter=adapter, n=n, **text_flags)
        outputs: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
        open_ = n
        while open_:
            out = q.get(timeout=timeout)
            outputs[out.index].append(out)
            if out.finish_reason is FinishReason.ERROR:
                return [RequestOutput.joined(outputs[out.index])] * n
            open_ -= out.finished
        return [RequestOutput.joined(outputs[i]) for i in range(n)]

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
                     rid: str | None = None, n: int = 1, **text_flags) -> AsyncIterator[RequestOutput]:
        """Async streaming of the request's outputs (every sequence's, by `index`, until each has
        finished); cancelling the consumer aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        ids = self.prompt_ids(prompt, messages, input_ids)
        rid = self.submit(ids, sampling or SamplingParams(), lambda c: loop.call_soon_threadsafe(q.put_nowait, c),
                          rid=rid, n=n, **text_flags)
        open_ = n
        try:
            while open_:
                chunk = await q.get()
                open_ = 0 if chunk.finish_reason is FinishReason.ERROR else open_ - chunk.finished
                yield chunk
        finally:
            if open_:
                self.abort(rid)

    def shutdown(self) -> None:
        """Stop the engine and give its memory back: the threads are joined, then the runner drops
        its weights, KV pool and native objects and freed heap pages go back to the OS
        (tests/integration/test_engine_memory.py holds RSS to it). Idempotent."""
        lanes, self._lanes = getattr(self, "_lanes", None), None
        for lane in lanes.others if lanes is not None else ():  # before the runner they step on closes
            lane.shutdown()
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # shut down already
            pass
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("engine loop did not stop within 30 s; its memory stays held")
            return
        if self._front is not None:  # the runner, its step thread and the tiers are the first engine's
            self.runner, self._runner_admin = None, None
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
        except Exception:
            if self._broken is None:
                raise
            log.info("engine loop stopped: %s", self._broken)  # every request ended with it (_recover)
        finally:
            self._driver.link.close()
            if self._front is None:  # another rank's engine shares the first one's step thread
                self._executor.shutdown(wait=True)
            self._loop.close()

    async def _recover(self, exc: Exception, reason: str) -> tuple[Scheduler, RunnerLink]:
        """The driver's failure policy: every open request ends with the error; a fresh
        scheduler (nothing the old one cached is trusted) drives a runner that forgot
        every request."""
        failed, self._requests, self._early = self._requests, OpenRequests(), []
        try:  # after the step running now, if any
            await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.reset)
        except Exception as e:  # a broken worker group: nothing will run again; strand no request
            self._broken = f"{reason}; the engine cannot recover: {e}"
            self._fail_open(failed, reason)
            self._fail_inbox()
            raise
        core = build_core(self._sched_config, self._worker_info(), self._hicache, self.kvstore)
        carry_counters(self.scheduler.stats, core.stats)
        self.scheduler = core
        self._fail_open(failed, reason)  # once a fresh scheduler serves what comes next
        return core, self._link()

    def _fail_open(self, failed: OpenRequests, reason: str) -> None:
        for req in failed.requests.values():
            self._send(req.owner, RequestOutput(req.rid, finished=True, finish_reason=FinishReason.ERROR, error=reason))

    def _fail_inbox(self) -> None:
        """End every request still queued for a driver that has stopped, with the reason."""
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                for index in range(len(item.texts)):
                    self._send(item, RequestOutput(item.rid, index=index, finished=True,
                                                        finish_reason=FinishReason.ERROR, error=self._broken))

    def _drain_inbox(self, core: Scheduler) -> None:
        """Between steps: stop strings found since the last step end their sequences, then new
        requests and aborts in the order they came."""
        early, self._early = self._early, []
        for crid, matched in early:
            core.finish_early(crid, FinishReason.STOP, matched)
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "abort":  # the core's abort outputs end the sequences at their sinks
                for crid in self._requests.core_rids(msg[1]):
                    core.abort(crid)
                continue
            h: _Handle = msg[1]
            try:
                self._requests.submit(core, h.rid, h.prompt_ids, h.sampling, len(h.texts), h.namespace, h.adapter, h)
            except (InvalidRequest, QueueFull) as exc:
                self._send(h, RequestOutput(h.rid, finished=True, finish_reason=FinishReason.ERROR, error=str(exc)))

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

    def expert_distribution(self, action: str):
        """SGLang's expert distribution recorder: "start", "stop" or "dump"; returns the recording
        as it then stands (an ExpertDump). Between two steps, without pausing admission.
        Raises AdminError (a model without experts, a dump before any start)."""
        from services.worker.model.expert_load import ExpertDump
        if action not in expert_distribution.ACTIONS:
            raise ValueError(f"action must be one of {sorted(expert_distribution.ACTIONS)}, got {action!r}")
        state = self.admin_call(self._runner_admin.call("ExpertDistribution", apb.ExpertDistributionRequest(
            action=expert_distribution.ACTIONS[action])))
        return ExpertDump(**expert_distribution.to_dict(state.expert_distribution))

    def flush_cache(self) -> int:
        """Drop every cached prefix (both tiers), as a scheduler's ModelAdmin.FlushCache does; the
        pages dropped. Raises AdminError, dropping nothing, while requests run or wait."""
        async def call() -> int:
            return flush(self.scheduler)
        others = self._lanes.others if self._lanes is not None else ()  # every data-parallel rank's cache
        return self.admin_call(call()) + sum(lane.flush_cache() for lane in others)

    def flush_kv_writes(self) -> None:
        """Wait until the pages written to the kvstore so far have landed (tests)."""
        if self.kvstore is not None:
            self.kvstore.flush()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output through its sequence's SequenceText (the detokenizer service's code), to its sink."""
        for req, out in self._requests.route(outputs):
            handle: _Handle = req.owner
            if out.finish_reason is FinishReason.ERROR:
                self._send(handle, out)
                continue
            out, stopped_here = handle.texts[out.index].apply(out)
            if stopped_here:  # a stop string the scheduler has not seen: end it between steps
                self._early.extend((crid, out.matched_stop) for crid in self._requests.end(req.rid, out.index))
            self._send(handle, out)

    def _send(self, handle: _Handle, chunk: RequestOutput) -> None:
        try:
            handle.sink(chunk)
        except Exception:  # a consumer that is gone (its event loop closed) loses its request
            log.warning("request %s: its consumer failed; aborting it", handle.rid, exc_info=True)
            for crid in self._requests.end(handle.rid):
                self.scheduler.abort(crid)
