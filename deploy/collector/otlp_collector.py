"""A small trace collector for the compose stack: OTLP/gRPC in, spans kept in memory, JSON out.

    python otlp_collector.py [--otlp-port 4317] [--http-port 16686] [--max-spans 200000]

It stands in for Jaeger where no image registry is reachable: it needs nothing but what the
radixmesh image already has (grpcio, opentelemetry-proto, aiohttp, prometheus-client), so it
runs from that image (compose.yaml's `collector`). What it serves:

    OTLP/gRPC  :4317   opentelemetry.proto.collector.trace.v1.TraceService/Export, and
                        grpc.health.v1 (`radixmesh healthcheck 127.0.0.1:4317`)
    HTTP       :16686  GET /api/services                 service names seen, sorted
                       GET /api/traces?service=S&limit=N  the newest N traces S took part in
                                                          (every span of each), newest first
                       GET /api/traces/{trace_id}         one trace's spans
                       GET /metrics                       spans received, spans and traces kept
                       GET /health

Spans are kept in arrival order; past --max-spans the oldest go. Nothing is written to disk:
a restart starts empty. Not a Jaeger: no UI, no search by tag or duration.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import signal
import sys

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
log = logging.getLogger("otlp_collector")


def _value(v):
    """An OTLP AnyValue as plain JSON."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


class Store:
    """Spans in arrival order, at most `max_spans`; traces indexed by id."""

    def __init__(self, max_spans: int) -> None:
        self.max_spans = max_spans
        self.spans: collections.deque[dict] = collections.deque()
        self.by_trace: dict[str, list[dict]] = {}
        self.registry = CollectorRegistry()
        self.received = Counter("otlp_collector_spans_received", "spans received", registry=self.registry)
        Gauge("otlp_collector_spans", "spans kept", registry=self.registry).set_function(lambda: len(self.spans))
        Gauge("otlp_collector_traces", "traces kept", registry=self.registry).set_function(
            lambda: len(self.by_trace))

    def add(self, span: dict) -> None:
        self.spans.append(span)
        self.by_trace.setdefault(span["traceID"], []).append(span)
        self.received.inc()
        while len(self.spans) > self.max_spans:
            old = self.spans.popleft()
            kept = self.by_trace[old["traceID"]]
            kept.remove(old)
            if not kept:
                del self.by_trace[old["traceID"]]

    def services(self) -> list[str]:
        return sorted({s["service"] for s in self.spans})

    def traces(self, service: str | None, limit: int) -> list[dict]:
        out, seen = [], set()
        for span in reversed(self.spans):  # newest first
            tid = span["traceID"]
            if tid in seen or (service and span["service"] != service):
                continue
            seen.add(tid)
            out.append({"traceID": tid, "spans": list(self.by_trace[tid])})
            if len(out) >= limit:
                break
        return out


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    async def Export(self, request, context):
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = resource.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.store.add({
                        "traceID": s.trace_id.hex(), "spanID": s.span_id.hex(),
                        "parentSpanID": s.parent_span_id.hex(), "service": service, "name": s.name,
                        "kind": KINDS.get(s.kind, str(s.kind)), "startTimeUnixNano": s.start_time_unix_nano,
                        "durationMs": (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "links": [{"traceID": lk.trace_id.hex(), "spanID": lk.span_id.hex()} for lk in s.links],
                        "status": s.status.code, "events": [e.name for e in s.events]})
        return trace_service_pb2.ExportTraceServiceResponse()


def http_app(store: Store) -> web.Application:
    def reply(obj) -> web.Response:
        return web.json_response({"data": obj}, dumps=json.dumps)

    async def services(request: web.Request) -> web.Response:
        return reply(store.services())

    async def traces(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            raise web.HTTPBadRequest(text="limit: an integer")
        return reply(store.traces(request.query.get("service"), max(1, limit)))

    async def trace(request: web.Request) -> web.Response:
        spans = store.by_trace.get(request.match_info["trace_id"].lower())
        if spans is None:
            raise web.HTTPNotFound(text="no such trace (never received, or dropped past --max-spans)")
        return reply([{"traceID": request.match_info["trace_id"].lower(), "spans": list(spans)}])

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(store.registry), content_type="text/plain")

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/api/services", services)
    app.router.add_get("/api/traces", traces)
    app.router.add_get("/api/traces/{trace_id}", trace)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthy)
    return app


async def serve(args: argparse.Namespace) -> int:
    store = Store(args.max_spans)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{args.host}:{args.otlp_port}")
    await server.start()
    runner = web.AppRunner(http_app(store), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.http_port).start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(json.dumps({"msg": "listening", "otlp_port": args.otlp_port, "http_port": args.http_port}))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await server.stop(1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--otlp-port", type=int, default=4317)
    parser.add_argument("--http-port", type=int, default=16686)
    parser.add_argument("--max-spans", type=int, default=200_000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
