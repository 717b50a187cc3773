"""What one hop of the mesh's output path costs a process in CPU when messages come one at a
time, as they do for a single stream (issue 41): a sender yields a small message every `--gap-ms`
(a decode step's spacing) and a receiver reads them, in two processes, over

  grpc: a grpc.aio server stream (the mesh's transport; uvloop on both sides, as the services run),
  raw:  a plain asyncio (uvloop) TCP stream of the same bytes: the floor of waking a process for
        a message on this machine.

Printed per transport: each side's CPU microseconds per message (user + system, every thread of
the process), the median of `--rounds` alternated rounds, and grpc over raw.

    .venv/bin/python bench/grpc_hop.py [--messages 300] [--gap-ms 7] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

WARMUP = 20  # messages read before the clocks start
PAYLOAD = b"x" * 64  # about one token's OutputBatch


def _identity(b: bytes) -> bytes:
    return b


async def _grpc_send(port: int, n: int, gap: float) -> float:
    import grpc

    done = asyncio.get_running_loop().create_future()

    async def stream(_request, _context):
        t0 = 0.0
        for i in range(n):
            if i == WARMUP:
                t0 = time.process_time()
            await asyncio.sleep(gap)
            yield PAYLOAD
        done.set_result((time.process_time() - t0) / (n - WARMUP))

    handler = grpc.method_handlers_generic_handler("hop.Hop", {"Stream": grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=_identity, response_serializer=_identity)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    cpu = await asyncio.wait_for(done, timeout=n * gap + 60)
    await server.stop(1)
    return cpu


async def _grpc_receive(port: int, n: int) -> float:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/hop.Hop/Stream", request_serializer=_identity,
                                    response_deserializer=_identity)(b"")
        return await _count(call.__aiter__().__anext__, n)


async def _raw_send(port: int, n: int, gap: float) -> float:
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        t0 = 0.0
        for i in range(n):
            if i == WARMUP:
                t0 = time.process_time()
            await asyncio.sleep(gap)
            writer.write(PAYLOAD)
            await writer.drain()
        done.set_result((time.process_time() - t0) / (n - WARMUP))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print("ready", flush=True)
    cpu = await asyncio.wait_for(done, timeout=n * gap + 60)
    server.close()
    return cpu


async def _raw_receive(port: int, n: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"g")
    try:
        return await _count(lambda: reader.readexactly(len(PAYLOAD)), n)
    finally:
        writer.close()


async def _count(next_message, n: int) -> float:
    """Read n messages; CPU seconds per message after the first WARMUP."""
    t0 = 0.0
    for i in range(n):
        await next_message()
        if i + 1 == WARMUP:
            t0 = time.process_time()
    return (time.process_time() - t0) / (n - WARMUP)


SIDES = {("grpc", "send"): _grpc_send, ("grpc", "receive"): _grpc_receive,
         ("raw", "send"): _raw_send, ("raw", "receive"): _raw_receive}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(transport: str, messages: int, gap_s: float) -> dict[str, float]:
    """The sender in a child process, the receiver here: {'send': us, 'receive': us} per message."""
    import uvloop
    port = _free_port()
    child = subprocess.Popen([sys.executable, __file__, "--side", f"{transport}:send", "--port", str(port),
                              "--messages", str(messages), "--gap-ms", str(gap_s * 1e3)],
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {transport} sender did not start")
        receive = uvloop.run(SIDES[(transport, "receive")](port, messages))
        send = json.loads(child.stdout.readline())["cpu_s"]
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    return {"send": send * 1e6, "receive": receive * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=7.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one sender (transport:send)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.messages <= WARMUP:
        p.error(f"--messages must be above {WARMUP}")
    if args.side:
        import uvloop
        transport, side = args.side.split(":")
        cpu = uvloop.run(SIDES[(transport, side)](args.port, args.messages, args.gap_ms / 1e3))
        print(json.dumps({"cpu_s": cpu}), flush=True)
        return 0
    runs: dict[str, list[dict]] = {"grpc": [], "raw": []}
    for _ in range(args.rounds):
        for transport in runs:
            runs[transport].append(one_round(transport, args.messages, args.gap_ms / 1e3))
    medians = {t: {side: statistics.median(r[side] for r in rs) for side in ("send", "receive")}
               for t, rs in runs.items()}
    import grpc
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}; "
          f"one {len(PAYLOAD)}-byte message every {args.gap_ms:g} ms, {args.messages} messages, "
          f"median of {args.rounds} rounds")
    print(f"{'':6}{'send us':>10}{'receive us':>12}")
    for t, m in medians.items():
        print(f"{t:6}{m['send']:10.0f}{m['receive']:12.0f}")
    ratio = {side: medians["grpc"][side] / medians["raw"][side] for side in ("send", "receive")}
    print(f"grpc / raw: send {ratio['send']:.2f}x, receive {ratio['receive']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians_us": medians, "grpc_over_raw": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
