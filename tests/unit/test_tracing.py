"""services/common/tracing.py: the on/off switch, propagation through the interceptors (a real
aio server and channel on loopback, spans kept in memory), and trace ids in log lines."""
from __future__ import annotations

import asyncio
import io
import json
import logging

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos.radixmesh.v1 import detokenizer_pb2 as dpb
from protos.radixmesh.v1 import detokenizer_pb2_grpc
from services.common import tracing
from services.common.logging import setup_logging
from services.detokenizer.service import DetokenizerService
from tests.unit.test_detokenizer import ByteTokenizer


@pytest.mark.parametrize("env,names", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
])
def test_the_switch(env, names):
    assert tracing.exporter_names(env) == names


def test_off_creates_no_exporter_and_records_no_span(monkeypatch):
    import opentelemetry.exporter.otlp.proto.grpc.trace_exporter as otlp

    def refuse(*a, **k):
        raise AssertionError("an exporter was created with tracing off")

    monkeypatch.setattr(otlp.OTLPSpanExporter, "__init__", refuse)
    assert tracing.setup("test", environ={}) is False
    assert not tracing.enabled()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    with tracing.tracer().start_as_current_span("x") as span:
        assert not span.is_recording() and not span.get_span_context().is_valid
    assert tracing.traceparent() == ""


def test_unknown_exporter_is_a_start_error():
    with pytest.raises(ValueError, match="unknown exporter"):
        tracing.setup("test", environ={"OTEL_TRACES_EXPORTER": "zipkin"})
    assert not tracing.enabled()


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.activate(provider)
    try:
        yield exporter
    finally:
        tracing.deactivate()


async def _detokenize_through_a_server(traced: bool) -> None:
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(DetokenizerService(ByteTokenizer()), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with tracing.channel(f"127.0.0.1:{port}") as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

            async def call() -> None:
                stream = detokenizer_pb2_grpc.DetokenizerStub(channel).Detokenize()
                await stream.write(dpb.DetokenizeRequest(index=0, token_ids=list(b"hi"), finished=True,
                                                         options=dpb.DetokenizeOptions()))
                assert (await stream.read()).text == "hi"
                await stream.done_writing()
                assert await stream.code() == grpc.StatusCode.OK

            if traced:
                with tracing.tracer().start_as_current_span("request"):
                    await call()
            else:
                await call()  # no current span: a background call makes no client span
            await asyncio.sleep(0.05)  # the client span ends when the call's status is in
    finally:
        await server.stop(0)


async def test_context_travels_in_grpc_metadata(spans):
    await _detokenize_through_a_server(traced=True)
    got = spans.get_finished_spans()
    client = next(s for s in got if s.kind == trace.SpanKind.CLIENT)
    server = next(s for s in got if s.kind == trace.SpanKind.SERVER)
    root = next(s for s in got if s.name == "request")
    inner = next(s for s in got if s.name == "detokenize")
    assert len(got) == 4  # health made none
    assert len({s.context.trace_id for s in got}) == 1
    assert client.parent.span_id == root.context.span_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote
    assert inner.parent.span_id == server.context.span_id
    assert client.attributes["rpc.grpc.status_code"] == 0 and inner.attributes["radixmesh.tokens"] == 2


async def test_a_call_outside_a_request_starts_only_a_server_trace(spans):
    await _detokenize_through_a_server(traced=False)
    got = spans.get_finished_spans()
    assert sorted(s.kind.name for s in got) == ["INTERNAL", "SERVER"]
    server = next(s for s in got if s.kind == trace.SpanKind.SERVER)
    assert server.parent is None


def test_log_lines_carry_the_trace_id(spans):
    out = io.StringIO()
    setup_logging("test", "info", stream=out)
    log = logging.getLogger("test")
    log.info("outside")
    with tracing.tracer().start_as_current_span("request") as span:
        log.info("inside")
    outside, inside = (json.loads(line) for line in out.getvalue().splitlines())
    assert "trace_id" not in outside
    assert inside["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert inside["span_id"] == f"{span.get_span_context().span_id:016x}"
