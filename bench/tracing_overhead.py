"""What tracing costs: output throughput of the same requests through `radixmesh up` with
tracing on (every span sampled, exported over OTLP/gRPC to a receiver in this process) and
off (no OTEL_* variables: no SDK at all), in the same run (issue 5; target: <= 3% loss).

Both meshes are started first, then measured one at a time, interleaved per round (off, on,
off, on, ...) so that a drift of the machine hits both alike. Requests: random ordinary
vocabulary prompts of --input-len token ids, --output-len tokens each, greedy, ignore_eos,
--concurrency in flight. Throughput = output tokens / wall time of a round; the ratio is
on / off over the rounds' totals. The receiver counts the spans it got, to show they came.

    .venv/bin/python bench/tracing_overhead.py [--requests 32 --concurrency 8 --rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
from concurrent import futures

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mesh_overhead as mo  # noqa: E402  (its Mesh child and request loop)


class SpanCounter:
    """An OTLP/gRPC TraceService that counts what it receives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans = 0
        lock, response = threading.Lock(), trace_service_pb2.ExportTraceServiceResponse

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(inner, request, context):  # noqa: N805
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with lock:
                    self.spans += n
                return response()

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def start_mesh(args, env: dict[str, str]) -> mo.Mesh:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return mo.Mesh(args)  # the child inherits this environment
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def measure(args, meshes: dict[str, mo.Mesh]) -> dict[str, list[tuple[int, float]]]:
    rng = random.Random(0)
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in meshes}
    for mesh in meshes.values():
        await mesh.start_session()
        await mo.run_concurrent(mo.random_prompts(2, args.input_len, rng), 2,
                                lambda ids, m=mesh: m.one(ids, 4))  # warm-up
    for r in range(args.rounds):
        prompts = mo.random_prompts(args.requests, args.input_len, rng)
        for name, mesh in meshes.items():
            records, wall = await mo.run_concurrent(prompts, args.concurrency,
                                                    lambda ids, m=mesh: m.one(ids, args.output_len))
            tokens = sum(rec.tokens for rec in records)
            results[name].append((tokens, wall))
            print(f"round {r + 1} tracing {name:3}: {tokens / wall:8.1f} output tok/s", flush=True)
    for mesh in meshes.values():
        await mesh.close_session()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--max-requests", type=int, default=32)
    p.add_argument("--max-running", type=int, default=32)
    args = p.parse_args()
    counter = SpanCounter()
    on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": counter.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
              "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    off_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    os.environ.clear()
    os.environ.update(off_env)
    meshes = {"off": start_mesh(args, {}), "on": start_mesh(args, on_env)}
    try:
        results = asyncio.run(measure(args, meshes))
    finally:
        for mesh in meshes.values():
            mesh.close()
        counter.server.stop(0)
    tput = {name: sum(t for t, _ in rs) / sum(w for _, w in rs) for name, rs in results.items()}
    ratio = tput["on"] / tput["off"]
    print(f"output throughput: off {tput['off']:.1f} tok/s, on {tput['on']:.1f} tok/s; "
          f"on/off = {ratio:.3f} ({(1 - ratio) * 100:+.1f}% loss); spans received: {counter.spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
