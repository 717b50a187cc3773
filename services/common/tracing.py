"""OpenTelemetry tracing, set up once per process and carried in gRPC metadata.

The switch (read by `setup`, which `run_service` and the gateway call at start):
  - on when OTEL_TRACES_EXPORTER names exporters (`otlp`, `console`, comma-separated),
    or, with it unset, when OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (then `otlp`);
  - off otherwise, or with OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true.
Off means: no SDK provider, no exporter, no interceptors, and `enabled()` is False,
so instrumented code pays one branch per call and nothing else. On: an SDK
TracerProvider (service.name `radixmesh-<service>`; the sampler from
OTEL_TRACES_SAMPLER/_ARG, default parentbased_always_on), a BatchSpanProcessor
(OTEL_BSP_*), OTLP over gRPC (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT/_HEADERS/_INSECURE...).

Propagation is W3C trace context (`traceparent`), in HTTP headers at the gateway
and in gRPC metadata between services. Servers make a SERVER span per RPC and
make it current for the handler; clients make a CLIENT span per RPC *only
inside a traced request* (a current span exists), so background polling (the
gateway's readiness checks, health, GetStats) makes no spans; methods in
UNTRACED make none on either side.

For a new service (e.g. the router), one call each:

    from services.common import tracing
    tracing.setup("router")                                  # run_service does this
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    channel = tracing.channel("10.0.0.7:50051", options)     # an aio channel (TLS when configured),
                                                             # with the client interceptor when on
(`services.common.server.serve` already adds `server_interceptors()`.)
"""
from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common import tls

log = logging.getLogger(__name__)

UNTRACED = frozenset({
    "/radixmesh.v1.Tokenizer/Ready", "/radixmesh.v1.Tokenizer/Info", "/radixmesh.v1.Tokenizer/GetLoad",
    "/radixmesh.v1.Scheduler/GetStats", "/radixmesh.v1.Scheduler/GetInfo",
    "/radixmesh.v1.Worker/GetInfo", "/radixmesh.v1.Worker/Step",  # Step: per-step spans instead
    "/radixmesh.v1.ModelAdmin/GetModelState",  # the gateway's readiness poll asks it every second
})
_UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_SERVER_ERRORS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}

_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False
_tracer: trace.Tracer = trace.NoOpTracer()
_provider = None


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    return _tracer


def exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The exporters the environment asks for; [] means tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        names = [n.strip() for n in named.split(",") if n.strip()]
        return [] if "none" in names else names
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def setup(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process if the environment says so; returns enabled().
    Raises ValueError for an exporter name it does not know (a config error at start)."""
    env = os.environ if environ is None else environ
    names = exporter_names(env)
    if not names:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name, env) for name in names]
    provider = TracerProvider(resource=Resource.create({"service.name": f"radixmesh-{service}",
                                                        "service.namespace": "radixmesh"}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    activate(provider)
    atexit.register(provider.shutdown)  # flushes what the batch processor holds
    log.info("tracing on", extra={"exporters": names})
    return True


def _exporter(name: str, env: Mapping[str, str]):
    if name == "otlp":
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "grpc")
        if protocol != "grpc":
            log.warning("only OTLP over gRPC is installed; using it", extra={"asked": protocol})
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()  # endpoint, headers, TLS, timeout, compression from OTEL_EXPORTER_OTLP_*
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (radixmesh knows otlp, console, none)")


def activate(provider) -> None:
    """Use `provider` (an SDK TracerProvider) from now on; tests pass one with an
    in-memory exporter. The first one also becomes the global provider."""
    global _enabled, _tracer, _provider
    if _provider is None:
        trace.set_tracer_provider(provider)
    _provider, _tracer, _enabled = provider, provider.get_tracer("radixmesh"), True


def deactivate() -> None:
    """Back to off (tests)."""
    global _enabled, _tracer
    _tracer, _enabled = trace.NoOpTracer(), False


# --- context <-> strings ---------------------------------------------------------------------
def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """A context holding the remote parent named by carrier['traceparent'] (else empty)."""
    return _PROPAGATOR.extract(carrier)


def traceparent(span: trace.Span | None = None) -> str:
    """The W3C traceparent of span (default: the current one); "" when it is not recording."""
    span = span or trace.get_current_span()
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def link_to(traceparent_value: str) -> Link | None:
    """A span link to the span a traceparent names (None for "" or garbage)."""
    if not traceparent_value:
        return None
    ctx = trace.get_current_span(extract({"traceparent": traceparent_value})).get_span_context()
    return Link(ctx) if ctx.is_valid else None


def ns(monotonic_s: float) -> int:
    """A time.monotonic() value as the epoch nanoseconds spans use."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def untraced(method: str) -> bool:
    return method in UNTRACED or method.startswith(_UNTRACED_PREFIXES)


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


# --- gRPC server ---------------------------------------------------------------------------
class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per RPC (child of the caller's traceparent), current while the
    handler runs. Async behaviours only (radixmesh has no others)."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or untraced(details.method):
            return handler
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        method = details.method
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                span, token = _server_span(method, context)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    _end_server_span(span, token, context)
            return handler._replace(**{kind: stream})
        if inspect.iscoroutinefunction(behavior):
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                span, token = _server_span(method, context)
                try:
                    return await behavior(request, context)
                finally:
                    _end_server_span(span, token, context)
            return handler._replace(**{kind: call})
        return handler


def _server_span(method: str, context: grpc.aio.ServicerContext):
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    parent = extract(carrier)
    span = _tracer.start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                              attributes=_rpc_attributes(method))
    return span, otel_context.attach(trace.set_span_in_context(span, parent))


def _end_server_span(span: trace.Span, token: object, context: grpc.aio.ServicerContext) -> None:
    code = context.code() or grpc.StatusCode.OK
    if isinstance(code, int):  # set through set_code(int) by some paths
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, context.details() or code.name))
    span.end()
    try:
        otel_context.detach(token)
    except Exception:  # closed from another context (a generator finalized elsewhere): nothing to undo
        pass


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """[the tracing interceptor] when tracing is on, else []."""
    return [_ServerInterceptor()] if _enabled else []


# --- gRPC client ---------------------------------------------------------------------------
_ending: set[asyncio.Task] = set()  # span-ending tasks, kept referenced until done


async def _intercept(continuation: Callable, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
    """A CLIENT span per RPC made inside a traced request, its context sent as `traceparent`."""
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    if not trace.get_current_span().get_span_context().is_valid or untraced(method):
        return await continuation(details, request)
    span = _tracer.start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method))
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *carrier.items())
    try:
        call = await continuation(details._replace(metadata=metadata), request)
    except BaseException as e:
        span.record_exception(e)
        span.set_status(Status(StatusCode.ERROR, str(e)))
        span.end()
        raise
    task = asyncio.ensure_future(_end_client_span(span, call))
    _ending.add(task)
    task.add_done_callback(_ending.discard)
    return call


# grpc.aio files an interceptor under the first of the four kinds it is an instance of,
# so each kind needs its own class.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await _intercept(continuation, details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await _intercept(continuation, details, request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await _intercept(continuation, details, request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await _intercept(continuation, details, request_iterator)


async def _end_client_span(span: trace.Span, call: Any) -> None:
    try:
        code = await call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, (await call.details()) or code.name))
    except BaseException:  # the loop is closing: still end the span
        pass
    finally:
        span.end()


def client_interceptors() -> list:
    """The tracing client interceptors (one per call kind) when tracing is on, else []."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()] if _enabled else []


def channel(address: str, options: Iterable[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """An aio channel to address (TLS when the process is configured for it, services/common/tls.py),
    propagating the trace when tracing is on."""
    return tls.aio_channel(address, options, client_interceptors() or None)
