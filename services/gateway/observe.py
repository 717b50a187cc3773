"""The gateway's spans and Prometheus metrics.

`middleware` makes one SERVER span per HTTP request, continuing the caller's W3C
`traceparent` header (or starting a trace), current while the handler runs, so
the gRPC call to the tokenizer carries it on. /metrics, /health and /ready make
no span. `generation_started` / `generation_done` put the OpenTelemetry GenAI
attributes on that span (the request's model, max_tokens, temperature; then the
response's usage and finish reasons) and feed the metrics, which `/metrics` on
the gateway's HTTP port serves.
"""
from __future__ import annotations

import time

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.common import tracing
from services.gateway.state import STATE

UNTRACED_PATHS = frozenset({"/metrics", "/health", "/ready"})


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = m.counter(r, "http_requests", "HTTP requests answered, by route and status",
                                  ("route", "status_code"))
        self.duration = m.histogram(r, "http_request_duration_seconds", "HTTP request to its last byte",
                                    m.LATENCY_BUCKETS, ("route",))
        self.ttft = m.histogram(r, "gateway_time_to_first_token_seconds", "HTTP request to the mesh's first event",
                                m.LATENCY_BUCKETS)
        self.prompt = m.counter(r, "gateway_prompt_tokens", "prompt tokens of answered generation requests")
        self.generation = m.counter(r, "gateway_generation_tokens", "completion tokens of answered requests")
        self.finished = m.counter(r, "gateway_finished_sequences", "sequences answered, by finish reason",
                                  ("finished_reason",))


METRICS = web.AppKey("radixmesh_gateway_metrics", GatewayMetrics)


def _route(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.path in UNTRACED_PATHS:
        return await handler(request)
    metrics: GatewayMetrics = request.app[METRICS]
    route, t0, status = _route(request), time.monotonic(), 499  # 499: the client went away
    span = None
    if tracing.enabled():
        span = tracing.tracer().start_span(
            f"{request.method} {route}", context=tracing.extract(request.headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path, "http.route": route})
    try:
        if span is None:
            response = await handler(request)
        else:
            with trace.use_span(span, end_on_exit=False):
                response = await handler(request)
        status = response.status
        return response
    finally:
        model = request.app[STATE].served_name or "unknown"
        metrics.requests.labels(model, route, str(status)).inc()
        metrics.duration.labels(model, route).observe(time.monotonic() - t0)
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()


def generation_started(req, model: str, t0: float, metrics: GatewayMetrics) -> None:
    """The first event came back (the mesh accepted the request)."""
    metrics.ttft.labels(model or "unknown").observe(time.monotonic() - t0)
    span = trace.get_current_span()
    if not span.is_recording():
        return
    sampling = req.calls[0].sampling
    span.set_attributes({
        "gen_ai.operation.name": "chat" if req.kind == "chat" else "text_completion",
        "gen_ai.request.model": req.model or model, "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p, "radixmesh.request_id": req.id,
        "gen_ai.request.choice.count": len(req.calls) * req.n})
    if not req.calls[0].fill_context:
        span.set_attribute("gen_ai.request.max_tokens", sampling.max_new_tokens)


def generation_done(col, model: str, metrics: GatewayMetrics) -> None:
    """Every sequence finished: usage and finish reasons, as the response reports them."""
    usage = col.usage()
    model = model or "unknown"
    metrics.prompt.labels(model).inc(usage["prompt_tokens"])
    metrics.generation.labels(model).inc(usage["completion_tokens"])
    reasons = [str(c.finish_reason or "unknown") for c in col.choices]
    for reason in reasons:
        metrics.finished.labels(model, reason).inc()
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({
            "gen_ai.response.model": model, "gen_ai.response.id": col.req.id,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": reasons,
            "radixmesh.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            **{f"radixmesh.speculative.{k}": v for k, v in usage.get("speculative", {}).items()}})
