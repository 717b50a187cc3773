"""The scheduler service's spans and Prometheus metrics, fed from its loop (no core changes).

Per core request (one sequence) the service calls, in order:
  submitted(crid, ...)         in Generate, with the RPC's SERVER span current
  outputs(outs, t)             for every RequestOutput the core emits, t = when it was known
  step(plan, t0, t1)           after each step: the plan was sent at t0, its result read at t1
  finished_early(crid, ...)    a stop string found downstream (the core emits no output)
  fail_all(message)            the worker stream broke: every open request errored

Spans (tracing on), under the scheduler's Generate span:
  `llm_request` (one per sequence; GenAI and latency attributes; the worker's step spans
  link to it), with children `queue` (submit → first step), one `prefill` per step that
  ran a prefill chunk of it (the step's wall time), and `decode` (first token → finish,
  `radixmesh.decode_steps` counts its steps: no span per token).
Latencies: queue = first step - submit; prefill = first token - first step; decode =
last token - first token; TTFT and e2e from submit at the scheduler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.common import tracing
from services.common.outputs import FinishReason, RequestOutput
from services.step.contract import StepPlan

ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)


@dataclass(eq=False)
class _Seq:
    arrival: float
    prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prefill_s: float = 0.0
    decode_steps: int = 0
    span: trace.Span | None = None  # llm_request
    queue: trace.Span | None = None
    decode: trace.Span | None = None
    traceparent: str = ""
    spec: tuple[int, int, int] = (0, 0, 0)  # speculation: verify steps, drafted, accepted (the latest output's)


@dataclass
class _Histograms:
    ttft: object
    itl: object
    e2e: object
    queue: object
    prefill: object
    decode: object
    prompt: object
    generation: object


class SchedulerTelemetry:
    def __init__(self, service) -> None:  # the SchedulerService: core, info, usage read at scrape time
        self._service = service
        self.model = "unknown"
        self._seqs: dict[str, _Seq] = {}
        r = self.registry = CollectorRegistry()
        self.success = m.counter(r, "request_success", "requests finished, by finish reason (stop, length)",
                                 ("finished_reason",))
        self.aborted = m.counter(r, "request_aborted", "requests aborted (client gone, drain, cancel)")
        self.errored = m.counter(r, "request_errored", "requests failed by an error (e.g. the worker was lost)")
        self.h = _Histograms(
            m.histogram(r, "time_to_first_token_seconds", "submit at the scheduler to the first token",
                        m.LATENCY_BUCKETS),
            m.histogram(r, "inter_token_latency_seconds", "time between a sequence's tokens", m.ITL_BUCKETS),
            m.histogram(r, "e2e_request_latency_seconds", "submit at the scheduler to finish", m.LATENCY_BUCKETS),
            m.histogram(r, "request_queue_time_seconds", "submit to the first step that runs the request",
                        m.LATENCY_BUCKETS),
            m.histogram(r, "request_prefill_time_seconds", "first step to first token", m.LATENCY_BUCKETS),
            m.histogram(r, "request_decode_time_seconds", "first token to last token", m.LATENCY_BUCKETS),
            m.histogram(r, "request_prompt_tokens", "prompt tokens per request", m.TOKEN_BUCKETS),
            m.histogram(r, "request_generation_tokens", "generated tokens per request", m.TOKEN_BUCKETS))
        self.accept_length = m.histogram(r, "spec_accept_length", "tokens a speculative verify item produced "
                                         "(accepted draft tokens + the target's own token)", ACCEPT_BUCKETS)
        r.register(m.LiveCollector(lambda: self.model if service.core is not None else None, self._live))
        self._itl = None  # the labelled ITL child, observed per token: looked up once per model

    def connected(self, model: str) -> None:
        self.model = model
        self._itl = self.h.itl.labels(model)

    def _live(self) -> dict[str, tuple[str, str, float]]:
        core, usage = self._service.core, self._service._usage
        s, kv = core.stats, core.kv
        used = kv.num_pages - kv.allocator.num_free
        return self._disaggregation(core) | {
            "num_requests_running": ("gauge", "requests running (holding KV)", len(core.running)),
            "num_requests_waiting": ("gauge", "requests waiting for admission", len(core.waiting)),
            "kv_pages_used": ("gauge", "KV pages not free (running requests' and cached)", used),
            "kv_pages_cached": ("gauge", "KV pages held by the prefix cache", kv.cache.cached_pages),
            "kv_pages_total": ("gauge", "KV pages in the pool", kv.num_pages),
            "token_usage": ("gauge", "fraction of KV pages in use", used / kv.num_pages if kv.num_pages else 0.0),
            "prefix_cache_queries": ("counter", "prefix-cache lookups (admissions)", s.prefix_queries),
            "prefix_cache_hits": ("counter", "admissions that reused a cached prefix", s.prefix_hits),
            "prefix_cache_query_tokens": ("counter", "tokens looked up in the prefix cache", s.prefix_query_tokens),
            "prefix_cache_hit_tokens": ("counter", "tokens found in the prefix cache", s.prefix_hit_tokens),
            "prefix_cache_hit_rate": ("gauge", "hit tokens / query tokens since start", s.cache_hit_rate),
            "num_retracted_requests": ("counter", "requests retracted to free KV (recomputed later)", s.retracted),
            "prompt_tokens": ("counter", "prompt tokens of finished requests", usage.prompt_tokens),
            "generation_tokens": ("counter", "tokens generated by finished requests", usage.completion_tokens),
            "cached_prompt_tokens": ("counter", "prompt tokens served from the prefix cache", usage.cached_tokens),
            "scheduler_steps": ("counter", "steps run by the worker", s.steps),
            "jump_forward_tokens": ("counter", "output tokens a grammar forced that rode a verify item instead "
                                               "of a model step of their own (jump-forward)", s.jump_forward_tokens),
            "grammar_waiting_requests": ("gauge", "requests waiting for their grammar to compile", len(core.grammars)),
            "spec_steps": ("counter", "steps that verified a speculative draft", s.spec_steps),
            "spec_step_share": ("gauge", "speculative steps / steps since start", s.spec_steps / s.steps if s.steps else 0.0),
            "spec_verify_items": ("counter", "speculative verify items (one request's draft each)", s.spec_verify_items),
            "spec_draft_tokens": ("counter", "tokens drafted and verified", s.spec_draft_tokens),
            "spec_accepted_tokens": ("counter", "drafted tokens the target accepted", s.spec_accepted_tokens),
            "spec_draft_seconds": ("counter", "the worker's time drafting", s.draft_seconds),
            "spec_verify_seconds": ("counter", "the worker's time in steps that verified a draft", s.verify_seconds),
        }

    @staticmethod
    def _disaggregation(core) -> dict[str, tuple[str, str, float]]:
        """A prefill side's KV transfer (its worker's send time, so GB/s is the engine's rate)."""
        rooms = core.prefill_rooms
        if rooms is None:
            return {}
        return {
            "kv_transfer_bytes": ("counter", "KV bytes sent to decode workers", rooms.sent_bytes),
            "kv_transfer_pages": ("counter", "KV pages sent to decode workers", rooms.sent_pages),
            "kv_transfer_seconds": ("counter", "worker seconds spent sending KV", rooms.sent_seconds),
            "kv_transfer_gbps": ("gauge", "KV bytes sent / worker seconds sending, since start (GB/s)",
                                 rooms.sent_bytes / rooms.sent_seconds / 1e9 if rooms.sent_seconds else 0.0),
            "disaggregation_rooms": ("gauge", "requests holding a room (prefilling, or pages crossing)",
                                     len(rooms.rooms)),
        }

    # --- hooks -------------------------------------------------------------------------------
    def submitted(self, crid: str, prompt_tokens: int, sampling, index: int, pd=None) -> None:
        """pd: the request's part in a disaggregated pair (its span says which side and room)."""
        seq = self._seqs[crid] = _Seq(time.monotonic(), prompt_tokens)
        if not tracing.enabled():
            return
        t = tracing.tracer()
        seq.span = t.start_span("llm_request", attributes={
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": sampling.max_new_tokens, "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p, "gen_ai.usage.input_tokens": prompt_tokens,
            "radixmesh.request_id": crid, "radixmesh.sequence_index": index,
            **({"radixmesh.disaggregation.role": pd.role, "radixmesh.disaggregation.room": pd.room} if pd else {})})
        ctx = trace.set_span_in_context(seq.span)
        seq.queue = t.start_span("queue", context=ctx)
        seq.traceparent = tracing.traceparent(seq.span)

    def traceparent(self, crid: str) -> str:
        seq = self._seqs.get(crid)
        return seq.traceparent if seq is not None else ""

    def step(self, plan: StepPlan, t0: float, t1: float, outs: list[RequestOutput]) -> None:
        on = tracing.enabled()
        lengths = self._service.core.accept_lengths if self._service.core is not None else ()
        while lengths:
            self.accept_length.labels(self.model).observe(lengths.popleft())
        for item in plan.items:
            seq = self._seqs.get(item.rid)
            if seq is None:
                continue
            if seq.scheduled is None:
                seq.scheduled = t0
                self.h.queue.labels(self.model).observe(t0 - seq.arrival)
                if seq.queue is not None:
                    seq.queue.end(tracing.ns(t0))
            if seq.first_token is None or len(item.input_ids) > 1:  # a prompt chunk, or a recompute
                seq.prefill_s += t1 - t0
                if on and seq.span is not None:
                    span = tracing.tracer().start_span(
                        "prefill", context=trace.set_span_in_context(seq.span), start_time=tracing.ns(t0),
                        attributes={"radixmesh.step_id": plan.step_id, "radixmesh.chunk_tokens": len(item.input_ids),
                                    "radixmesh.start_pos": item.start_pos, "radixmesh.recompute": seq.first_token
                                    is not None, "radixmesh.batch_size": len(plan.items)})
                    span.end(tracing.ns(t1))
            else:
                seq.decode_steps += 1
        self.outputs(outs, t1)

    def outputs(self, outs: list[RequestOutput], t: float) -> None:
        for out in outs:
            seq = self._seqs.get(out.rid)
            if seq is None:
                continue
            if out.token_ids:
                if seq.first_token is None:
                    seq.first_token = t
                    self.h.ttft.labels(self.model).observe(t - seq.arrival)
                    if seq.span is not None:
                        seq.decode = tracing.tracer().start_span(
                            "decode", context=trace.set_span_in_context(seq.span), start_time=tracing.ns(t))
                elif seq.last_token is not None:
                    (self._itl or self.h.itl.labels(self.model)).observe((t - seq.last_token) / len(out.token_ids))
                seq.last_token = t
            if out.spec_verify_steps:
                seq.spec = (out.spec_verify_steps, out.spec_draft_tokens, out.spec_accepted_tokens)
            if out.finished:
                self._finish(out.rid, out.finish_reason or FinishReason.STOP, out.prompt_tokens, out.completion_tokens,
                             out.cached_tokens, out.error, t)

    def finished_early(self, crid: str, prompt: int, completion: int, cached: int) -> None:
        self._finish(crid, FinishReason.STOP, prompt, completion, cached, None, time.monotonic())

    def fail_all(self, message: str) -> None:
        now = time.monotonic()
        for crid in list(self._seqs):
            self._finish(crid, FinishReason.ERROR, self._seqs[crid].prompt_tokens, 0, 0, message, now)

    def _finish(self, crid: str, reason: FinishReason, prompt: int, completion: int, cached: int,
                error: str | None, t: float) -> None:
        seq = self._seqs.pop(crid, None)
        if seq is None:
            return
        label = self.model
        if reason is FinishReason.ABORT:
            self.aborted.labels(label).inc()
        elif reason is FinishReason.ERROR:
            self.errored.labels(label).inc()
        else:
            self.success.labels(label, reason.value).inc()
        h = self.h
        e2e = t - seq.arrival
        h.e2e.labels(label).observe(e2e)
        h.prompt.labels(label).observe(prompt)
        h.generation.labels(label).observe(completion)
        prefill = (seq.first_token - seq.scheduled) if seq.first_token and seq.scheduled else 0.0
        decode = (seq.last_token - seq.first_token) if seq.first_token and seq.last_token else 0.0
        if seq.first_token is not None:
            h.prefill.labels(label).observe(prefill)
            h.decode.labels(label).observe(decode)
        if seq.span is None:
            return
        end = tracing.ns(t)
        if seq.queue is not None and seq.scheduled is None:
            seq.queue.end(end)  # aborted or failed while waiting
        if seq.decode is not None:
            seq.decode.set_attribute("radixmesh.decode_steps", seq.decode_steps)
            if seq.spec[0]:
                seq.decode.set_attributes({"radixmesh.spec.verify_steps": seq.spec[0],
                                           "radixmesh.spec.proposed_tokens": seq.spec[1],
                                           "radixmesh.spec.accepted_tokens": seq.spec[2]})
            seq.decode.set_attribute("gen_ai.usage.output_tokens", completion)
            seq.decode.end(end)
        attrs = {
            "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
            "gen_ai.response.finish_reasons": [reason.value], "radixmesh.cached_tokens": cached,
            "gen_ai.latency.e2e": e2e, "gen_ai.latency.time_in_model_prefill": prefill,
            "gen_ai.latency.time_in_model_decode": decode}
        if seq.scheduled is not None:
            attrs["gen_ai.latency.time_in_queue"] = seq.scheduled - seq.arrival
        if seq.first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = seq.first_token - seq.arrival
        seq.span.set_attributes(attrs)
        if reason is FinishReason.ERROR:
            seq.span.set_status(Status(StatusCode.ERROR, error or "request failed"))
        seq.span.end(end)
