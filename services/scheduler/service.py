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
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import scheduler_pb2 as spb
from protos.radixmesh.v1 import scheduler_pb2_grpc
from protos.radixmesh.v1 import worker_pb2, worker_pb2_grpc
from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import scheduler_pb2 as spb2
from protos.radixmesh.v2 import scheduler_pb2_grpc as scheduler2_grpc
from services.common import tls, tracing
from services.common.batches import drain_batches
from services.common.admin_forward import carry_model_state
from services.common.convert import sampling_from_proto
from services.common.outputs import FinishReason, RequestOutput, spec_counters
from services.common.outputs_convert import error_to_proto, output_to_proto
from services.common.refusal import Refused
from services.common.sampling_params import InvalidRequest
from services.common.server import Readiness
from services.scheduler.convert import carry_counters, output_events, stats_proto
from services.scheduler.core_factory import build_core, fit_config
from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.grpc_link import GrpcStepLink
from services.step.contract import DP_RANK_METADATA
from services.scheduler.open_requests import OpenRequests
from services.scheduler.pd_link import PDLink, pd_spec
from services.scheduler.outputs import QueueFull
from services.scheduler.scheduler import Scheduler
from services.scheduler.telemetry import SchedulerTelemetry
from services.step.contract import StepPlan
from services.step.convert import plan_to_proto

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Owner:
    """Where a request's outputs go: the Outputs subscriber (radixmesh.v2, `text_options` set,
    attached to each sequence's first output), or a radixmesh.v1 Generate call's queue of
    ("out", RequestOutput) | ("error", code, message)."""
    text_options: opb.TextOptions | None = None
    queue: asyncio.Queue | None = None
    started: set[int] = field(default_factory=set)  # sequences whose first output went out
    expiry: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Subscriber:
    """The Outputs stream: one OutputBatch per step, queued until the stream writes it."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """radixmesh.v1.Scheduler (stats, cache, info, and the per-request Generate of v1), plus the
    core of radixmesh.v2.Scheduler, which `OutputsServicer` serves."""

    def __init__(self, config) -> None:  # a SchedulerServiceConfig
        self.config = config
        self.core: Scheduler | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        self.connected = False
        self._channel: grpc.aio.Channel | None = None
        self._worker: worker_pb2_grpc.WorkerStub | None = None
        self._link: GrpcStepLink | None = None  # the Step stream
        self._driver: StepDriver | None = None
        self._requests = OpenRequests()  # owners: _Owner
        self._subscriber: _Subscriber | None = None
        self._early: list[tuple[str, str | None]] = []  # (core rid, matched stop) to finish as stop
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._usage = cpb.Usage()
        self.telemetry = SchedulerTelemetry(self)
        self.pd = PDLink(self, getattr(config, "disaggregation_heartbeat_s", 1.0))  # disaggregation's handshake
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
        if self.core.prefill_rooms is not None:
            self.pd.start_ticker()

    def bound(self, address: str) -> None:
        """The address the server bound (its port resolved): the default bootstrap address."""
        self.listen_address = address

    def wake(self) -> None:
        """New work for the loop (a room's other side spoke)."""
        self._wake.set()

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
        self._check_disaggregation(info)
        core = build_core(fit_config(self.config.scheduler, info), info, getattr(self.config, "hicache", None),
                          self._kvstore_probe(info), getattr(self.config, "disaggregation", None))
        if self.core is not None:
            carry_counters(self.core.stats, core.stats)
        self.core, self.info = core, info
        m = info.model
        self.telemetry.connected(m.name)
        rank = getattr(self.config, "dp_rank", 0)  # the worker's data-parallel rank it plans for
        self._link = GrpcStepLink(self._worker.Step(metadata=((DP_RANK_METADATA, str(rank)),)), self._plan_message,
                                  self.step_bound_s, self._set_stalled, self._worker)
        self.connected, self.stalled = True, None
        self.readiness.set(True)
        log.info("worker connected", extra={"worker": self.config.worker_addr, "model": m.name,
                                            "kv_pages": info.num_kv_pages, "page_size": info.page_size})

    def _check_disaggregation(self, info) -> None:
        """The worker must play the part this scheduler plays; a prefill side advertises where
        decode schedulers attach (GetInfo carries it to the tokenizer, and on to the router)."""
        pd = getattr(self.config, "disaggregation", None)
        mode, worker_mode = pd.disaggregation_mode if pd else "null", info.disaggregation_mode or "null"
        if mode != worker_mode:
            raise RuntimeError(f"--disaggregation-mode {mode} here, but worker {self.config.worker_addr} runs "
                               f"--disaggregation-mode {worker_mode}: give both the same")
        if mode == "prefill":
            info.bootstrap_address = bootstrap_address(self.config, getattr(self, "listen_address", ""))

    def _kvstore_probe(self, info):
        """The worker's kvstore, for Exists: the core starts each call without blocking this loop
        (BlockingKVStore.start_exists, services/scheduler/store_probe.py) and reads an answer that
        is not in probe_timeout_s after the wait it asked for as a miss."""
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
        self.pd.lost(reason)
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

    def _count(self, prompt: int, completion: int, cached: int, spec: dict[str, int]) -> None:
        u = self._usage
        u.prompt_tokens, u.completion_tokens, u.cached_tokens = (
            u.prompt_tokens + prompt, u.completion_tokens + completion, u.cached_tokens + cached)
        for name, n in spec.items():
            setattr(u, name, getattr(u, name) + n)

    # --- outputs: one OutputBatch per step to the subscriber --------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self.pd.pump(self.core)
        unavailable = set()
        for out in outputs:
            if out.finished:
                self._count(out.prompt_tokens, out.completion_tokens, out.cached_tokens, spec_counters(out))
                if self.pd.ended(out.rid):
                    unavailable.add(out.rid)
        batch = opb.OutputBatch()
        version = self.core.limits.weights_version
        for req, out in self._requests.route(outputs):
            owner: _Owner = req.owner
            if req.done and owner.expiry is not None:
                owner.expiry.cancel()
            if owner.queue is not None:
                owner.queue.put_nowait(("out", out))
            elif out.finish_reason is FinishReason.ERROR:
                code = grpc.StatusCode.UNAVAILABLE if out.rid in unavailable else grpc.StatusCode.INTERNAL
                batch.errors.append(error_to_proto(req.rid, code, out.error or "request failed",
                                                   owner.text_options.reply_to))
            else:
                msg = output_to_proto(out, version)
                if out.index not in owner.started:
                    owner.started.add(out.index)
                    msg.text_options.CopyFrom(owner.text_options)
                batch.outputs.append(msg)
        self._publish(batch)

    def _publish(self, batch: opb.OutputBatch) -> None:
        if (batch.outputs or batch.errors) and self._subscriber is not None:
            self._subscriber.queue.put_nowait(batch)

    def _fail(self, rid: str, code: grpc.StatusCode, message: str) -> opb.RequestError | None:
        """End request `rid` with an error: its v1 call gets it at once; for v2 the RequestError
        is returned for the caller to publish. The core's sequences are the caller's to abort."""
        req = self._requests.requests.get(rid)
        if req is None:
            return None
        owner: _Owner = req.owner
        self._requests.end(rid)
        if owner.expiry is not None:
            owner.expiry.cancel()
        if owner.queue is not None:
            owner.queue.put_nowait(("error", code, message))
            return None
        return error_to_proto(rid, code, message, owner.text_options.reply_to)

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        batch = opb.OutputBatch()
        for rid in list(self._requests.requests):
            error = self._fail(rid, code, message)
            if error is not None:
                batch.errors.append(error)
        self._publish(batch)

    def _expire(self, rid: str, core: Scheduler) -> None:
        """--request-timeout-s passed: abort the request's open sequences in `core` (their KV is
        freed at the next schedule()) and end it with DEADLINE_EXCEEDED."""
        log.warning("request deadline passed: aborting", extra={"rid": rid, "timeout_s": self.config.request_timeout_s})
        crids = self._requests.core_rids(rid)
        if self.core is core:
            for crid in crids:
                core.abort(crid)
            self._wake.set()
        error = self._fail(rid, grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the request did not finish within --request-timeout-s={self.config.request_timeout_s:g}s"
                           + (f" ({self.stalled})" if self.stalled else ""))
        if error is not None:
            self._publish(opb.OutputBatch(errors=[error]))

    def subscribe(self) -> _Subscriber:
        """A new Outputs stream replaces the old one (which ends)."""
        old, self._subscriber = self._subscriber, _Subscriber()
        if old is not None:
            old.queue.put_nowait(None)
        return self._subscriber

    def unsubscribe(self, sub: _Subscriber) -> None:
        """The Outputs stream ended: unless a new one replaced it, every request whose outputs it
        carried is aborted (there is nobody left to read them)."""
        if self._subscriber is not sub:
            return
        self._subscriber = None
        for rid, req in list(self._requests.requests.items()):
            if req.owner.queue is None:
                for crid in self._requests.end(rid):
                    if self.core is not None:
                        self.core.abort(crid)
        self._wake.set()

    async def drain(self, deadline: float) -> None:
        """Let open requests finish; abort those left shortly before the deadline so their
        streams end with FINISH_REASON_ABORT rather than being cut; end the Outputs stream (a
        long-lived call would hold the server's drain to its deadline); then leave the worker."""
        margin = min(2.0, 0.25 * self.config.common.drain_timeout_s)
        await _until(lambda: not self._requests, deadline - margin)
        if self._requests and self.core is not None:
            log.warning("drain: aborting requests", extra={"requests": len(self._requests)})
            for rid in list(self._requests.requests):
                for crid in self._requests.core_rids(rid):
                    self.core.abort(crid)
            self._wake.set()
            await _until(lambda: not self._requests, deadline)
        if self._subscriber is not None:  # end the Outputs stream after what it still holds
            sub, self._subscriber = self._subscriber, None
            sub.queue.put_nowait(None)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._link is not None:
            self._link.close()
        await self.pd.close()
        if self._channel is not None:
            await self._channel.close()

    # --- intake ----------------------------------------------------------------------
    def admit(self, rid: str, ids: list[int], sampling_msg, n: int, namespace: str, adapter: str,
              owner: _Owner, pd=None) -> None:
        """Queue a request for `owner`. Raises Refused with the gRPC code."""
        core = self.core
        if core is None or not self.connected:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the scheduler has no worker connected")
        if self.stalled is not None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, self.stalled)
        if owner.queue is None and self._subscriber is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "no detokenizer is reading the scheduler's outputs")
        if not rid:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "rid is required")
        sampling = sampling_from_proto(sampling_msg)
        try:
            req = self._requests.submit(core, rid, ids, sampling, n, namespace, adapter, owner, pd)
        except InvalidRequest as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except QueueFull as e:
            self._wake.set()
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        for i, crid in enumerate(req.core_rids):
            self.telemetry.submitted(crid, len(ids), sampling, i, pd)
        if owner.text_options is not None and tracing.enabled():  # the detokenizer's span joins the trace
            owner.text_options.traceparent = self.telemetry.traceparent(req.core_rids[0])
        timeout = self.config.request_timeout_s
        if timeout is not None:  # one timer per request, not one per token
            owner.expiry = asyncio.get_running_loop().call_later(timeout, self._expire, rid, core)
        self._wake.set()

    def abort(self, rid: str, index: int | None, as_stop: bool, matched_stop: str) -> bool:
        """Abort the request's open sequences (or one); with `as_stop`, end them as finished by
        the stop string found downstream (no further output: the finder already ended them)."""
        if self.core is None:
            return False
        if as_stop:
            req = self._requests.requests.get(rid)
            crids = self._requests.end(rid, index)
            self._early.extend((crid, matched_stop or None) for crid in crids)
            if req is not None and req.owner.queue is not None:  # a v1 call: its stream says how it ended
                for crid in crids:
                    req.owner.queue.put_nowait(("out", RequestOutput(
                        rid, index=req.core_rids.index(crid), finished=True, finish_reason=FinishReason.STOP,
                        matched_stop=matched_stop or None)))
        else:  # the core's abort outputs end the sequences downstream too
            crids = self._requests.core_rids(rid, index)
            for crid in crids:
                self.core.abort(crid)
        self._wake.set()
        return bool(crids)

    # --- radixmesh.v1 RPCs ------------------------------------------------------------
    async def Generate(self, request: spb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        """radixmesh.v1: one request's token ids on a stream of its own (no text)."""
        owner = _Owner(queue=asyncio.Queue())
        rid = request.rid or uuid.uuid4().hex
        try:
            self.admit(rid, list(request.input_ids), request.sampling, request.n if request.HasField("n") else 1,
                       request.namespace, request.adapter, owner)
        except Refused as e:
            await context.abort(e.code, e.message)
        req = self._requests.requests[rid]
        try:
            while not (req.done and owner.queue.empty()):
                item = await owner.queue.get()
                if item[0] == "error":
                    yield cpb.GenerateResponse(error=cpb.Error(code=item[1].value[0], message=item[2]))
                    return
                out: RequestOutput = item[1]
                if out.finish_reason is FinishReason.ERROR:
                    yield cpb.GenerateResponse(error=cpb.Error(code=grpc.StatusCode.INTERNAL.value[0],
                                                               message=out.error or "request failed"))
                    return
                for event in output_events(out, self.core.limits.weights_version):
                    yield event
        finally:  # finished, failed, timed out, or cancelled by the client
            if owner.expiry is not None:
                owner.expiry.cancel()
            for crid in self._requests.end(rid):
                if self.core is not None:
                    self.core.abort(crid)
            self._wake.set()

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:
        index = request.index if request.HasField("index") else None
        return spb.AbortResponse(found=self.abort(request.rid, index, request.as_stop, request.matched_stop))

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


class OutputsServicer(scheduler2_grpc.SchedulerServicer):
    """radixmesh.v2.Scheduler over a SchedulerService: Submit, Abort, Outputs."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    async def Submit(self, request: spb2.SubmitRequest, context: grpc.aio.ServicerContext) -> spb2.SubmitResponse:
        options = opb.TextOptions()
        options.CopyFrom(request.text_options)
        del options.stop[:]
        options.stop.extend(request.sampling.stop)
        try:
            self.service.admit(request.rid, list(request.input_ids), request.sampling,
                               request.n if request.HasField("n") else 1, request.namespace, request.adapter,
                               _Owner(text_options=options), pd_spec(request.disaggregation))
        except Refused as e:
            await context.abort(e.code, e.message)
        return spb2.SubmitResponse()

    async def Abort(self, request: spb2.AbortRequest, context: grpc.aio.ServicerContext) -> spb2.AbortResponse:
        index = request.index if request.HasField("index") else None
        return spb2.AbortResponse(found=self.service.abort(request.rid, index, request.as_stop, request.matched_stop))

    async def Outputs(self, request: spb2.OutputsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[opb.OutputBatch]:
        sub = self.service.subscribe()
        await context.send_initial_metadata(())  # tells the detokenizer it is the subscriber now
        try:
            async for batch in drain_batches(sub.queue):
                yield batch
        finally:
            self.service.unsubscribe(sub)


def bootstrap_address(config, bound: str = "") -> str:
    """Where decode schedulers reach this one's PrefillBootstrap: --bootstrap-address, else the
    address the server bound (a wildcard host becomes this machine's name)."""
    if config.bootstrap_address:
        return config.bootstrap_address
    host, _, port = (bound or config.common.listen).rpartition(":")
    if port in ("", "0"):
        raise RuntimeError(f"--disaggregation-mode prefill listens on {config.common.listen}: give "
                           "--bootstrap-address HOST:PORT, the address decode schedulers reach it at")
    if host in ("0.0.0.0", "[::]", ""):
        import socket
        host = socket.gethostname()
    return f"{host}:{port}"


async def _until(done, deadline: float, poll_s: float = 0.05) -> None:
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
