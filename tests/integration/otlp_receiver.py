"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService, keeping what it gets."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class Span:
    service: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str
    attributes: dict
    links: list[tuple[str, str]]  # (trace_id, span_id)
    start_ns: int
    end_ns: int
    status_code: int = 0
    events: list[str] = field(default_factory=list)


def _value(v: common_pb2.AnyValue):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`with Receiver() as r:` serves on r.endpoint (http://127.0.0.1:PORT); r.spans() lists what arrived."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Receiver":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0)

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        resource.get("service.name", ""), s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.name, KINDS.get(s.kind, str(s.kind)), {a.key: _value(a.value) for a in s.attributes},
                        [(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links], s.start_time_unix_nano,
                        s.end_time_unix_nano, s.status.code, [e.name for e in s.events]))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)
