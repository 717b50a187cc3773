"""services/common/server.py over real gRPC: a toy service in a subprocess on loopback.

Checks the lifecycle a router and a process manager rely on: NOT_SERVING (and
application RPCs refused) while loading, SERVING after, reflection lists every service, and on SIGTERM with an
RPC in flight: NOT_SERVING, new RPCs refused with UNAVAILABLE, the in-flight
stream completes, exit status 0.
"""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from protos.radixmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "tests" / "integration" / "_toy_service.py"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Toy:
    """The subprocess, with its JSON log lines collected by a reader thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TOY), "--listen", "127.0.0.1:0", *args],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        self.log: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        listening = self.wait_log(lambda e: e.get("msg") == "listening", timeout=30)
        self.address = f"127.0.0.1:{listening['port']}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:  # a traceback from a crash: keep it visible
                self.lines.put({"msg": "non-json", "line": line})

    def wait_log(self, match: Callable[[dict], bool], timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                event = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.log.append(event)
            if match(event):
                return event
        raise AssertionError(f"no matching log line; saw {self.log}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def toy() -> Iterator[Toy]:
    t = Toy("--load-seconds", "3", "--chunk-seconds", "0.1", "--drain-timeout-s", "20")
    try:
        yield t
    finally:
        t.kill()


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_health(channel: grpc.Channel, want: int, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while (status := _health(channel)) != want:
        assert time.monotonic() < end, f"health stayed {status}, wanted {want}"
        time.sleep(0.05)


def test_lifecycle_health_reflection_and_drain(toy: Toy) -> None:
    with grpc.insecure_channel(toy.address) as channel:
        # Loading: up and answering health, but not serving yet.
        assert _health(channel) == NOT_SERVING
        assert _health(channel, "radixmesh.v1.Scheduler") == NOT_SERVING
        echo = channel.unary_unary("/radixmesh.test.Echo/Echo")
        with pytest.raises(grpc.RpcError) as early:
            echo(b"early", timeout=5)
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "starting" in early.value.details()
        _wait_health(channel, SERVING)
        assert _health(channel, "radixmesh.v1.Scheduler") == SERVING
        assert _health(channel, "radixmesh.test.Echo") == SERVING

        db = ProtoReflectionDescriptorDatabase(channel)
        assert set(db.get_services()) >= {
            "radixmesh.v1.Scheduler", "radixmesh.test.Echo",
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        # The generated service's descriptors are served too (grpcurl works).
        assert db.FindFileContainingSymbol("radixmesh.v1.Scheduler").name == "radixmesh/v1/scheduler.proto"

        assert echo(b"ping", timeout=5) == b"ping"

        # An in-flight stream of 20 chunks (~2 s); wait for its first chunk.
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        call = stub.Generate(scheduler_pb2.GenerateRequest(
            rid="r1", sampling=common_pb2.SamplingParams(max_new_tokens=20)), timeout=30)
        events = [next(call)]
        rest: list[common_pb2.GenerateResponse] = []
        reader = threading.Thread(target=lambda: rest.extend(call))
        reader.start()

        toy.proc.send_signal(signal.SIGTERM)
        _wait_health(channel, NOT_SERVING, timeout=10)
        assert reader.is_alive(), "the stream ended before the drain could be observed"
        with pytest.raises(grpc.RpcError) as refused:
            echo(b"late", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused_stream:
            next(stub.Generate(scheduler_pb2.GenerateRequest(rid="r2"), timeout=5))
        assert refused_stream.value.code() == grpc.StatusCode.UNAVAILABLE

        reader.join(timeout=20)
        events += rest
        assert [e.WhichOneof("event") for e in events] == ["chunk"] * 20 + ["finish"]
        assert [e.chunk.token_ids[0] for e in events[:20]] == list(range(20))

    assert toy.proc.wait(timeout=20) == 0
    toy.wait_log(lambda e: e.get("msg") == "stopped", timeout=5)
    assert any(e.get("msg") == "on_drain called" for e in toy.log)
    assert all(e.get("service") == "toy" for e in toy.log if e.get("msg") != "non-json")


def _long_stream(toy: Toy) -> tuple[grpc.Channel, Any]:
    """A Generate stream that would take hours (100,000 chunks, 0.1 s apart), once the toy is serving:
    it ends early only when the toy cuts it off (or at the call's 120 s deadline: DEADLINE_EXCEEDED)."""
    channel = grpc.insecure_channel(toy.address)
    _wait_health(channel, SERVING)
    call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(scheduler_pb2.GenerateRequest(
        rid="long", sampling=common_pb2.SamplingParams(max_new_tokens=100_000)), timeout=120)
    next(call)
    return channel, call


@pytest.mark.parametrize("second_signal", [False, True])
def test_stragglers_are_cancelled_at_the_deadline_or_on_a_second_signal(second_signal: bool) -> None:
    toy = Toy("--drain-timeout-s", "30" if second_signal else "1")
    try:
        channel, call = _long_stream(toy)
        toy.proc.send_signal(signal.SIGTERM)
        if second_signal:
            _wait_health(channel, NOT_SERVING, timeout=10)
            toy.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        # cut off by the toy (not the call's own deadline), long before the stream's end
        assert ended.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), ended.value
        assert toy.proc.wait(timeout=60) == 0
        reason = "second signal: stopping now" if second_signal else "drain deadline passed"
        toy.wait_log(lambda e: e.get("msg") == reason, timeout=30)
        channel.close()
    finally:
        toy.kill()


def test_sigterm_while_loading_exits_zero() -> None:
    toy = Toy("--load-seconds", "60")
    try:
        toy.proc.send_signal(signal.SIGTERM)
        assert toy.proc.wait(timeout=20) == 0
    finally:
        toy.kill()


def test_bad_flag_value_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, str(TOY), "--listen", "nonsense"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "--listen must be HOST:PORT" in proc.stderr
