"""The scheduler service: the Scheduler core on the event loop, one Step stream to the worker.

Threading model: everything runs on one asyncio loop. Generate handlers
validate and submit synchronously (so bad input fails the call at once with
INVALID_ARGUMENT, a full queue with RESOURCE_EXHAUSTED), then read their
outputs from a per-request queue. One loop task drives the worker with the
StepDriver (services/scheduler/driver.py) over the Step stream
(services/scheduler/grpc_link.py): schedule() → write the plan → deliver the
previous step's outputs while the worker computes → read the result →
process(). Overlapped scheduling (on unless --disable-overlap-schedule): the
next plan is built and written before the last one's result is read, so the
worker finds it queued when it finishes a step. Early finishes (stop strings
found by the detokenizer) are applied between steps; aborts go through the
core's own abort queue, which schedule() applies.

Worker loss (the driver's failure policy; a loop error gets the same): when the
Step stream breaks, every open request fails with an
Error (UNAVAILABLE), the core is rebuilt empty (the worker's KV may be gone,
so no cached prefix can be trusted) and the service reconnects; Generate is
refused with UNAVAILABLE meanwhile and gRPC health is NOT_SERVING (the
tokenizer's Ready, hence the gateway's /ready, follow it) until the new stream
is up.

Watchdog: a worker that hangs (e.g. SIGSTOPped) breaks no stream. A step
unanswered past its bound (--step-stall-floor-s plus --step-stall-per-token-s
per token of the plan, from when the worker started it) marks the worker
stalled: health NOT_SERVING and Generate refused with UNAVAILABLE until the step
completes. Requests in flight are ended by their deadline (--request-timeout-s,
from arrival): an Error with DEADLINE_EXCEEDED, and the request aborted in the
core (its KV is freed at the next schedule()).

Observability: services/scheduler/telemetry.py gets the loop's plans, outputs and
timings (spans per request, Prometheus metrics served on --metrics-port); each new
request's spec carries its span's traceparent so the worker's step spans link to it.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import scheduler_pb2 as spb
from protos.radixmesh.v1 import scheduler_pb2_grpc
from protos.radixmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common import tls, tracing
from services.common.admin_forward import carry_model_state
from services.common.convert import sampling_from_proto
from services.common.outputs import FinishReason, RequestOutput, spec_counters
from services.common.outputs_convert import finish_to_proto
from services.common.sampling_params import InvalidRequest
from services.common.server import Readiness
from services.scheduler.convert import Usage, carry_counters, output_events, stats_proto
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.grpc_link import GrpcStepLink
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import ModelLimits, Scheduler
from services.scheduler.telemetry import SchedulerTelemetry
from services.step.contract import StepPlan
from services.step.convert import plan_to_proto

log = logging.getLogger(__name__)

MAX_N = 64
_SEED_MOD = 2**63


@dataclass(eq=False)
class _Stream:
    """One Generate call: its core requests (one per sequence) and the queue its handler reads.
    Queue items: ("out", index, RequestOutput) | ("stop", index, matched) | ("error", code, message)."""
    rid: str
    core_rids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    open: set[int] = field(default_factory=set)
    usage: Usage = field(default_factory=Usage)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config) -> None:  # a SchedulerServiceConfig
        self.config = config
        self.core: Scheduler | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        self.connected = False
        self._channel: grpc.aio.Channel | None = None
        self._worker: worker_pb2_grpc.WorkerStub | None = None
        self._link: GrpcStepLink | None = None  # the Step stream
        self._driver: StepDriver | None = None
        self._streams: dict[str, _Stream] = {}
        self._owner: dict[str, tuple[_Stream, int]] = {}  # core rid -> (stream, index)
        self._early: list[tuple[str, str | None]] = []  # (core rid, matched stop) to finish as stop
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._usage = cpb.Usage()
        self.telemetry = SchedulerTelemetry(self)
        self.readiness = Readiness()  # mirrored into gRPC health by run_service
        self.stalled: str | None = None  # why the watchdog thinks the worker hangs, while it does

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Wait for the worker (health NOT_SERVING meanwhile), then drive it."""
        # A short reconnect backoff: a restarted worker is found soon after it listens again.
        self._channel = tls.aio_channel(self.config.worker_addr, options=[
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._worker = worker_pb2_grpc.WorkerStub(self._channel)
        await self._connect(self.config.worker_wait_s)
        hooks = DriverHooks(self._recover, between_steps=self._apply_early, emitted=self.telemetry.outputs,
                            stepped=self._stepped, deliver=self._deliver)
        depth = 1 if self.config.scheduler.disable_overlap_schedule else 2
        self._driver = StepDriver(hooks, self.core, self._link, depth, wake=self._wake)
        self._loop_task = asyncio.create_task(self._driver.run(), name="scheduler-loop")

    async def _connect(self, wait_s: float) -> None:
        """GetInfo with retries until the worker answers, a fresh core, a new Step stream."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = await self._worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.config.worker_addr} did not answer within "
                                       f"{wait_s:.0f}s: {e.code().name} {e.details()}") from e
                await asyncio.sleep(0.5)
        m = info.model
        limits = ModelLimits(info.num_kv_pages, info.page_size, m.max_position_embeddings, m.vocab_size,
                             tuple(m.eos_token_ids), info.num_host_pages, info.page_bytes, info.model_identity,
                             info.weights_version or "0", info.kv_layout, info.max_draft_tokens,
                             info.verify_max_rows, info.max_loras)
        cfg = self.config.scheduler
        if info.max_requests and cfg.max_running_requests > info.max_requests:
            log.warning("capping max_running_requests to the worker's page-table rows",
                        extra={"requested": cfg.max_running_requests, "worker_max_requests": info.max_requests})
            cfg = replace(cfg, max_running_requests=info.max_requests)
        core = Scheduler(cfg, limits, getattr(self.config, "hicache", None), self._kvstore_probe(info),
                         {a.name: a.identity for a in info.adapters})
        if self.core is not None:
            carry_counters(self.core.stats, core.stats)
        self.core, self.info = core, info
        self.telemetry.connected(m.name)
        self._link = GrpcStepLink(self._worker.Step(), self._plan_message, self.step_bound_s, self._set_stalled,
                                  self._worker)
        self.connected, self.stalled = True, None
        self.readiness.set(True)
        log.info("worker connected", extra={"worker": self.config.worker_addr, "model": m.name,
                                            "kv_pages": info.num_kv_pages, "page_size": info.page_size})

    def _kvstore_probe(self, info):
        """The worker's kvstore, for Exists (blocks this loop for at most its probe timeout)."""
        if not info.kvstore_addr:
            return None
        if getattr(self, "_kvstore", None) is None or self._kvstore.address != info.kvstore_addr:
            import torch

            from services.kvstore.blocking import BlockingKVStore
            from services.kvstore.page_codec import PageSpec
            m = info.model  # only Exists is called: the spec just has to be well formed
            spec = PageSpec(m.num_hidden_layers, info.page_size, m.num_key_value_heads, m.head_dim, torch.float32)
            hicache = getattr(self.config, "hicache", None)
            self._kvstore = BlockingKVStore(info.kvstore_addr, spec, probe_timeout_s=0.2,
                                            auth_token=hicache.kvstore_auth_token() if hicache else None)
        return self._kvstore

    async def _recover(self, exc: Exception, reason: str) -> tuple[Scheduler, GrpcStepLink]:
        """The driver's failure policy: fail what was open, then a fresh core on a new
        stream (the worker resets too)."""
        self.connected, self.stalled = False, None
        self.readiness.set(False, reason)
        self._fail_all(grpc.StatusCode.UNAVAILABLE, reason)
        self.telemetry.fail_all(reason)
        await self._connect(float("inf"))
        return self.core, self._link

    def _stepped(self, plan: StepPlan, started: float, ended: float, outputs: list[RequestOutput]) -> None:
        self.telemetry.step(plan, started, ended, outputs)
        if self.config.check_invariants:
            self.core.check_invariants()

    def step_bound_s(self, plan: StepPlan) -> float:
        """How long the worker may take for `plan` before the watchdog calls it stalled."""
        tokens = sum(len(item.input_ids) for item in plan.items)
        return self.config.step_stall_floor_s + self.config.step_stall_per_token_s * tokens

    def _set_stalled(self, reason: str | None) -> None:
        """The watchdog's verdict: while stalled, health is NOT_SERVING and new requests are refused."""
        self.stalled = reason
        self.readiness.set(reason is None, reason)

    def _plan_message(self, plan: StepPlan) -> worker_pb2.StepPlan:
        msg = plan_to_proto(plan)
        if tracing.enabled():
            for spec in msg.new_requests:
                spec.traceparent = self.telemetry.traceparent(spec.rid)
        return msg

    def _apply_early(self, core: Scheduler) -> None:
        early, self._early = self._early, []
        for crid, matched in early:
            req = core.running.get(crid)
            if req is not None:  # it yields no output: count its usage here
                self._count(len(req.prompt_ids), len(req.output_ids), req.cached_tokens, spec_counters(req))
                self.telemetry.finished_early(crid, len(req.prompt_ids), len(req.output_ids), req.cached_tokens)
                core.finish_early(crid, FinishReason.STOP, matched)
            else:  # waiting (e.g. retracted): nothing to keep, drop it
                core.abort(crid)

    def _count(self, prompt: int, completion: int, cached: int, spec: dict[str, int]) -> None:
        u = self._usage
        u.prompt_tokens, u.completion_tokens, u.cached_tokens = (
            u.prompt_tokens + prompt, u.completion_tokens + completion, u.cached_tokens + cached)
        for name, n in spec.items():
            setattr(u, name, getattr(u, name) + n)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            owner = self._owner.get(out.rid)
            if out.finished:
                self._count(out.prompt_tokens, out.completion_tokens, out.cached_tokens, spec_counters(out))
            if owner is not None:
                stream, index = owner
                stream.queue.put_nowait(("out", index, out))

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(("error", code, message))

    async def drain(self, deadline: float) -> None:
        """Let open requests finish; abort those left shortly before the deadline so their
        streams end with FINISH_REASON_ABORT rather than being cut; then leave the worker."""
        margin = min(2.0, 0.25 * self.config.common.drain_timeout_s)
        await _until(lambda: not self._streams, deadline - margin)
        if self._streams and self.core is not None:
            log.warning("drain: aborting requests", extra={"requests": len(self._streams)})
            for crid in list(self._owner):
                self.core.abort(crid)
            self._wake.set()
            await _until(lambda: not self._streams, deadline)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._link is not None:
            self._link.close()
        if self._channel is not None:
            await self._channel.close()

    # --- RPCs ------------------------------------------------------------------------
    async def Generate(self, request: spb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        core = self.core
        if core is None or not self.connected:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler has no worker connected")
        if self.stalled is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.stalled)
        arrived = time.monotonic()
        n = request.n if request.HasField("n") else 1
        rid = request.rid or uuid.uuid4().hex
        ids, sampling = list(request.input_ids), sampling_from_proto(request.sampling)
        try:
            if not 1 <= n <= MAX_N:
                raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
            if rid in self._streams:
                raise InvalidRequest(f"request id {rid!r} is already in use")
            core.validate(ids, sampling)
            core.cache_namespace(request.namespace, request.adapter)  # an unknown adapter fails here
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        stream = _Stream(rid, [rid] if n == 1 else [f"{rid}/{i}" for i in range(n)], open=set(range(n)))
        submitted: list[str] = []
        try:
            for i, crid in enumerate(stream.core_rids):
                core.submit(crid, ids, sampling, (seed + i) % _SEED_MOD, request.namespace, request.adapter)
                submitted.append(crid)
                self.telemetry.submitted(crid, len(ids), sampling, i)
        except (QueueFull, InvalidRequest) as e:
            for crid in submitted:
                core.abort(crid)
            self._wake.set()
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, QueueFull) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        self._streams[rid] = stream
        for i, crid in enumerate(stream.core_rids):
            self._owner[crid] = (stream, i)
        self._wake.set()
        timeout = self.config.request_timeout_s
        # One timer per request, not one per token: at the deadline it aborts and queues the error.
        expiry = None if timeout is None else asyncio.get_running_loop().call_at(
            arrived + timeout, self._expire, stream, core)
        try:
            while stream.open:
                for event in self._events(stream, await stream.queue.get(), core.limits.weights_version):
                    yield event
        finally:  # finished, failed, timed out, or cancelled by the client
            if expiry is not None:
                expiry.cancel()
            for i in stream.open:
                if self.core is core:
                    core.abort(stream.core_rids[i])
            for crid in stream.core_rids:
                self._owner.pop(crid, None)
            self._streams.pop(rid, None)
            self._wake.set()

    def _expire(self, stream: _Stream, core: Scheduler) -> None:
        """--request-timeout-s passed: abort the stream's open sequences in `core` (their KV is
        freed at the next schedule()) and end the stream with DEADLINE_EXCEEDED."""
        if not stream.open:
            return
        log.warning("request deadline passed: aborting", extra={"rid": stream.rid,
                                                                "timeout_s": self.config.request_timeout_s})
        if self.core is core:
            for i in stream.open:
                core.abort(stream.core_rids[i])
            self._wake.set()
        stream.queue.put_nowait(("error", grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the request did not finish within --request-timeout-s="
                                 f"{self.config.request_timeout_s:g}s" + (f" ({self.stalled})" if self.stalled else "")))

    @staticmethod
    def _events(stream: _Stream, item: tuple, weights_version: str) -> list[cpb.GenerateResponse]:
        kind, a, b = item
        if kind == "error":
            stream.open.clear()
            return [cpb.GenerateResponse(error=cpb.Error(code=a.value[0], message=b))]
        if a not in stream.open:
            return []  # the sequence already ended (a stop string found downstream)
        if kind == "stop":
            stream.open.discard(a)
            return [cpb.GenerateResponse(finish=finish_to_proto(a, FinishReason.STOP, b or None))]
        out: RequestOutput = b
        if out.finish_reason is FinishReason.ERROR:
            stream.open.clear()
            return [cpb.GenerateResponse(error=cpb.Error(code=grpc.StatusCode.INTERNAL.value[0],
                                                         message=out.error or "request failed"))]
        if out.finished:
            stream.open.discard(a)
        return output_events(a, out, stream.usage, weights_version)

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:
        stream = self._streams.get(request.rid)
        if stream is None or self.core is None:
            return spb.AbortResponse(found=False)
        indices = [request.index] if request.HasField("index") else sorted(stream.open)
        found = False
        for i in indices:
            if i not in stream.open:
                continue
            found = True
            crid = stream.core_rids[i]
            if request.as_stop:
                self._early.append((crid, request.matched_stop or None))
                stream.queue.put_nowait(("stop", i, request.matched_stop))
            else:
                self.core.abort(crid)
        self._wake.set()
        return spb.AbortResponse(found=found)

    async def GetStats(self, request: spb.GetStatsRequest, context: grpc.aio.ServicerContext) -> spb.SchedulerStats:
        if self.core is None:
            return spb.SchedulerStats(worker_connected=False)
        return stats_proto(self.core, self.info.page_size, self.connected, self._usage)

    async def FlushCache(self, request: spb.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> spb.FlushCacheResponse:
        core = self.core
        if core is None:
            return spb.FlushCacheResponse(flushed=False, message="no worker connected")
        running, waiting = len(core.running), len(core.waiting)
        if not core.flush_cache():
            return spb.FlushCacheResponse(flushed=False, message=(
                f"{running} running and {waiting} waiting requests hold or need the cache"))
        return spb.FlushCacheResponse(flushed=True)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        if self.info is None or not self.connected:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler has no worker connected")
        return self.info

    def model_changed(self, state) -> None:
        """An admin call changed the worker's adapters or weights (an admin_pb2.ModelState):
        GetInfo answers with the new ones."""
        carry_model_state(self.info, state)


async def _until(done, deadline: float, poll_s: float = 0.05) -> None:
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
