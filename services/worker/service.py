"""The worker service: the model and the KV pool behind one Step stream.

`Step` is the scheduler ↔ worker contract on the wire (protos/radixmesh/v1/
worker.proto): a StepResult answers each StepPlan, in order. Each step runs on
one dedicated thread, so the event loop keeps answering health checks and
GetInfo while torch computes, and two steps never overlap. Plans are handed to
that thread as they arrive, so a plan the scheduler sent ahead (overlapped
scheduling) runs right after the current one, in order.

One scheduler at a time: a new Step stream starts from an empty request table
(the scheduler that opens it has no requests on this worker), so a scheduler
that reconnects after a broken stream finds no stale state. A stream waits a
few seconds for the previous one to be torn down, then is refused.

Observability: each step is a `worker.step` span (a root: a step serves many
requests) with a span link to every request it ran (the traceparent each new
request's spec carries); each request also gets one `worker.request` span in its
own trace, from its spec to its release, counting its steps and tokens. Metrics
count steps, their time and tokens.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import worker_pb2 as pb
from protos.radixmesh.v1 import worker_pb2_grpc
from services.common import metrics as m
from services.common import tracing
from services.common.admin_forward import carry_model_state
from services.common.grammar.constraint import Constraint
from services.common.model_path import resolve_model_path
from services.common.sampling_params import InvalidRequest
from services.step.convert import plan_from_proto, result_to_proto
from services.worker.config import WorkerConfig
from services.worker.dp_streams import DpStreams
from services.worker.expert_metrics import ExpertCollector
from services.worker.info import worker_info
from services.worker.step_loop import StepLoop

GROUP_LOST_EXIT_S = 1.0  # from a group's lost rank to the worker's exit

log = logging.getLogger(__name__)

STREAM_TAKEOVER_S = 10.0  # how long a new Step stream waits for the previous one to end


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, hicache=None) -> None:  # hicache: a common.hicache_config.HiCacheConfig
        self.config = config
        self.hicache = hicache
        self.runner = None  # a ModelRunner once start() returned
        self.dp_streams: DpStreams | None = None  # --enable-dp-attention: a Step stream per rank
        self.info: pb.WorkerInfo | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="worker-step")
        # Held by every step while it runs; model administration (services/worker/admin_service.py)
        # takes it to change weights or adapters between two steps.
        self.model_lock = threading.Lock()
        self._stream_lock = asyncio.Lock()
        self._traced: dict[str, _Traced] = {}  # rid -> its link and worker.request span (tracing on)
        r = self.registry = CollectorRegistry()
        self._steps = m.counter(r, "worker_steps", "steps executed")
        self._step_time = m.histogram(r, "worker_step_seconds", "a step's time on the worker (forward + sampling)",
                                      m.LATENCY_BUCKETS)
        self._step_tokens = m.counter(r, "worker_tokens", "tokens run through the model (prefill + decode)")
        self._batch = m.histogram(r, "worker_batch_size", "requests per step", m.TOKEN_BUCKETS)
        self._model = "unknown"
        self._compile_time = m.histogram(r, "worker_grammar_compile_seconds",
                                         "compiling a constraint's grammar (cache misses)", m.LATENCY_BUCKETS)
        self._grammar_executor = ThreadPoolExecutor(1, thread_name_prefix="worker-grammar")
        r.register(m.LiveCollector(lambda: self._model if self.info is not None else None, lambda: {
            "kv_pages_total": ("gauge", "KV pages in the pool", self.info.num_kv_pages),
            "kv_page_size": ("gauge", "tokens per KV page", self.info.page_size),
            "kv_capacity_tokens": ("gauge", "tokens the KV pool holds (pages x page size; its dtype: "
                                   "kv_cache_info)", self.info.num_kv_pages * self.info.page_size),
            **self._grammar_metrics(), **(self.runner.device_stats.metrics() if self.runner is not None else {})}))
        r.register(m.InfoCollector(lambda: self._model if self.info is not None else None, "kv_cache",
                                   "the KV pool's storage dtype (--kv-cache-dtype resolved)",
                                   lambda: {"kv_dtype": self.info.kv_dtype}))
        # MoE models: tokens per expert, EP imbalance and rebalances (services/worker/expert_metrics.py)
        r.register(ExpertCollector(lambda: self._model if self.info is not None else None, lambda: self.runner))

    async def start(self) -> None:
        """Load the model on the step thread (health stays NOT_SERVING meanwhile)."""
        loop = asyncio.get_running_loop()
        self.runner, eos = await loop.run_in_executor(self._executor, self._load)
        if self.config.enable_dp_attention:
            self.dp_streams = DpStreams(self.runner, self._executor, STREAM_TAKEOVER_S, self._observe,
                                        lambda msg: self._step_span(msg) if tracing.enabled() else None)
        self.info = worker_info(self.runner, eos, self._tiers if self.hicache is not None else None,
                                self.hicache.kvstore_addr if self.hicache is not None else None)
        self._model = self.info.model.name
        # The grammar backend (xgrammar, the vocabulary's bytes: ~2 s) is built now, off the step
        # thread, so the first constrained request does not wait for it.
        loop.run_in_executor(self._grammar_executor, self._warm_grammars)

    def _load(self):
        # torch is imported here, not at module level: `radixmesh serve` of the
        # other services imports this package's siblings without paying for it.
        from services.worker.group.leader import create_runner, load_rank_checkpoint

        from services.worker.attention.cpu_backend import CpuBackend
        from services.worker.lead_cpu import thread_ids

        before = thread_ids() - {threading.get_native_id()}  # the event loop's and gRPC's threads
        path = resolve_model_path(self.config.model)
        # gguf: no float32 copy of the blocks; a group's leader: its own part only
        checkpoint = load_rank_checkpoint(self.config, path)
        runner = create_runner(self.config, checkpoint, self.hicache, on_lost=self._group_lost)
        lead_cpu = runner.backend.lead_cpu if isinstance(runner.backend, CpuBackend) else None
        if lead_cpu is not None:  # threads they start later inherit their CPUs
            lead_cpu.move_off(before)
        if self.hicache is not None:
            from services.worker.host_pool import attach_tiers
            self.kvstore, self._tiers = attach_tiers(runner, self.hicache, checkpoint.source)
        return runner, stop_ids(path, runner.model_config.eos_token_ids)

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        return self.info

    async def PrepareGrammar(self, request: cpb.Constraint, context: grpc.aio.ServicerContext
                             ) -> pb.PrepareGrammarResponse:
        """Compile on the grammar thread (the step thread goes on); INVALID_ARGUMENT with the reason."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        constraint = Constraint(request.kind, request.spec)
        with tracing.tracer().start_as_current_span("grammar.compile", attributes={
                "radixmesh.grammar.kind": constraint.kind, "radixmesh.grammar.key": constraint.key}) as span:
            try:
                cached, seconds = await asyncio.get_running_loop().run_in_executor(
                    self._grammar_executor, self.runner.grammars.prepare, constraint)
            except InvalidRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            span.set_attributes({"radixmesh.grammar.cached": cached, "radixmesh.grammar.compile_seconds": seconds})
        if not cached:
            self._compile_time.labels(self._model).observe(seconds)
        return pb.PrepareGrammarResponse(cached=cached, compile_seconds=seconds)

    def _warm_grammars(self) -> None:
        try:
            self.runner.grammars.backend
        except Exception as e:  # e.g. weights without a tokenizer: constraints fail when asked for
            log.warning("grammar backend unavailable", extra={"error": str(e)})

    def _grammar_metrics(self) -> dict:
        g = self.runner.grammars.stats if self.runner is not None else None
        if g is None:
            return {}
        return {
            "worker_grammar_cache_hits": ("counter", "constraints whose grammar was compiled already", g.hits),
            "worker_grammar_cache_misses": ("counter", "constraints compiled", g.misses),
            "worker_grammar_cache_entries": ("gauge", "compiled grammars cached", len(self.runner.grammars)),
            "worker_grammar_masked_rows": ("counter", "sampled rows masked by a grammar", g.masked_rows),
            "worker_grammar_jump_forward_tokens": ("counter", "tokens a grammar forced, appended without a model step",
                                                   g.jump_forward_tokens),
        }

    async def Step(self, request_iterator: AsyncIterator[pb.StepPlan],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResult]:
        if self.dp_streams is not None:  # one stream per data-parallel rank (dp_streams.py)
            async for result in self.dp_streams.serve(request_iterator, context):
                yield result
            return
        try:
            await asyncio.wait_for(self._stream_lock.acquire(), STREAM_TAKEOVER_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler holds this worker's Step stream")
        loop = asyncio.get_running_loop()
        # Plans go to the step thread as soon as they arrive: one queued behind the one
        # running (overlapped scheduling) starts the moment that one ends, without a trip
        # through this loop. Results come back in plan order (services/worker/step_loop.py).
        results: asyncio.Queue = asyncio.Queue()
        steps = StepLoop(self.runner, self._step, lambda item: loop.call_soon_threadsafe(results.put_nowait, item))
        reader = None
        try:
            try:
                await loop.run_in_executor(self._executor, self._reset)
            except Exception as exc:  # a broken worker group: no step can run
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker cannot step: {exc}")
            log.info("step stream opened", extra={"peer": context.peer()})
            loop.run_in_executor(self._executor, steps.run)  # the next stream's _reset queues behind it
            reader = asyncio.create_task(self._read_plans(request_iterator, steps))
            while (item := await results.get()) is not None:
                step_id, result = item
                if isinstance(result, Exception):  # the scheduler fails the step's requests and reconnects
                    log.error("step %d failed", step_id, exc_info=result)
                    await context.abort(grpc.StatusCode.INTERNAL, f"worker step {step_id} failed: {result}")
                yield result
            await reader  # its error, if the stream broke
            log.info("step stream closed by the scheduler")
        finally:
            if reader is not None:
                reader.cancel()
            steps.close()
            self._stream_lock.release()

    @staticmethod
    async def _read_plans(request_iterator: AsyncIterator[pb.StepPlan], steps: StepLoop) -> None:
        """Hand each plan to the step thread as it arrives."""
        try:
            async for msg in request_iterator:
                steps.put(msg)
        finally:
            steps.finish()

    def _step_span(self, msg: pb.StepPlan):
        traced, tracer = self._traced, tracing.tracer()
        for rid in msg.released_rids:
            _end(traced.pop(rid, None))
        for spec in msg.new_requests:
            link = tracing.link_to(spec.traceparent)
            if link is not None and spec.rid not in traced:
                traced[spec.rid] = _Traced(link, tracer.start_span(
                    "worker.request", context=tracing.extract({"traceparent": spec.traceparent}),
                    attributes={"radixmesh.request_id": spec.rid, "radixmesh.recompute": bool(spec.output_ids)}))
        links, prefill = [], 0
        for it in msg.items:
            t = traced.get(it.rid)
            n = len(it.input_ids)
            prefill += n if n > 1 or not it.sample else 0
            if t is not None:
                links.append(t.link)
                t.steps, t.tokens = t.steps + 1, t.tokens + n
        return tracer.start_span(
            "worker.step", kind=SpanKind.INTERNAL, context=Context(), links=links,  # a root
            attributes={"radixmesh.step_id": msg.step_id, "radixmesh.batch_size": len(msg.items),
                        "radixmesh.new_requests": len(msg.new_requests), "radixmesh.prefill_tokens": prefill,
                        "radixmesh.tokens": sum(len(it.input_ids) for it in msg.items)})

    def _observe(self, msg: pb.StepPlan, seconds: float) -> None:
        model = self._model
        self._steps.labels(model).inc()
        self._step_time.labels(model).observe(seconds)
        self._step_tokens.labels(model).inc(sum(len(it.input_ids) for it in msg.items))
        self._batch.labels(model).observe(len(msg.items))

    def _step(self, msg: pb.StepPlan) -> pb.StepResult | Callable[[], pb.StepResult]:
        """One plan, on the step thread: its span, the runner, its metrics → its result, or on
        CUDA possibly a callable that completes it (StepLoop calls it before posting)."""
        t0, span = time.monotonic(), self._step_span(msg) if tracing.enabled() else None
        try:
            with self.model_lock:  # CUDA: its tokens may still be crossing to the host (ModelRunner.execute)
                result = self.runner.execute(plan_from_proto(msg), defer=self.runner.device.type == "cuda")
        except Exception as exc:
            if span is not None:
                span.record_exception(exc)
                span.end()
            raise
        self._observe(msg, time.monotonic() - t0)
        if span is not None:
            span.set_attribute("radixmesh.forward_seconds", result.forward_seconds)
            span.end()
        if self.runner.has_deferred:  # completed when the step loop posts it, after the next step is queued
            def complete() -> pb.StepResult:
                self.runner.finish_pending()  # on the step thread (StepLoop's flush), inside or between steps
                return result_to_proto(result)
            return complete
        return result_to_proto(result)

    def model_changed(self, state) -> None:
        """An admin call changed adapters or weights (an admin_pb2.ModelState): GetInfo follows."""
        carry_model_state(self.info, state)

    @staticmethod
    def _group_lost(why: str) -> None:
        """A rank of this worker's group died (its watchdog's thread): the group cannot step any
        more. The step in flight has failed at its collective, so the scheduler has its error;
        after a moment for that error to reach the clients, the worker exits, naming the rank,
        and its launcher stops the mesh."""
        log.error("worker group broken: %s; exiting", why)
        time.sleep(GROUP_LOST_EXIT_S)
        os._exit(1)

    def _reset(self) -> None:
        """Drop every request's state: a new stream's scheduler knows none of them."""
        for t in self._traced.values():
            _end(t)
        self._traced.clear()
        n = len(self.runner.requests)
        if n:
            self.runner.reset()
            log.info("dropped state of %d requests of a previous stream", n)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)


class _Traced:
    __slots__ = ("link", "span", "steps", "tokens")

    def __init__(self, link, span) -> None:
        self.link, self.span, self.steps, self.tokens = link, span, 0, 0


def _end(t: _Traced | None) -> None:
    if t is not None:
        t.span.set_attributes({"radixmesh.steps": t.steps, "radixmesh.tokens": t.tokens})
        t.span.end()


def stop_ids(path: str, model_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end generation: the model's and its tokenizer's (as the Engine does)."""
    from services.tokenizer.text_tokenizer import load_tokenizer

    eos = set(model_eos)
    try:
        eos |= set(load_tokenizer(path).eos_token_ids)
    except (FileNotFoundError, ValueError) as e:  # weights without a tokenizer: the model's ids only
        log.warning("no tokenizer eos ids", extra={"error": str(e)})
    return tuple(sorted(eos))
