"""`radixmesh serve gateway` as a process: flags, the `listening` line, gRPC
health following readiness, and SIGTERM draining an in-flight stream. The
backend is the stub Tokenizer of test_gateway_grpc_backend, served from a
thread of the test process."""
from __future__ import annotations

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import tokenizer_pb2_grpc
from services.common.config import flags_from_dataclass
from services.gateway.main import CONFIG_CLASS
from tests.doubles.v2_generate import add_both
from tests.unit.test_gateway_grpc_backend import StubTokenizer

REPO = Path(__file__).resolve().parents[2]


class StubThread:
    """The stub tokenizer (health NOT_SERVING until `serve()`), on a loop in a thread."""

    def __init__(self) -> None:
        # asyncio's own loop: grpc.aio servers on uvloop in a second thread of a process missed a
        # cancellation under load once (CI); the gateway process itself runs on uvloop.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = self.run(self._start())

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        self.stub = StubTokenizer()
        self.server = grpc.aio.server()
        add_both(self.stub, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def serve(self) -> None:
        self.run(self.health.set("", health_pb2.HealthCheckResponse.SERVING))

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


class GatewayProcess:
    def __init__(self, tokenizer_port: int, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "gateway", "--http-port", "0", "--listen",
             "127.0.0.1:0", "--tokenizer-addr", f"127.0.0.1:{tokenizer_port}", "--ready-interval-s", "0.1", *flags],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        listening = self.wait_log("listening")
        self.grpc_addr = f"127.0.0.1:{listening['port']}"
        self.url = listening["url"]

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                self.lines.put({"msg": "non-json", "line": line})

    def wait_log(self, msg: str, timeout: float = 30) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                event = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.log.append(event)
            if event.get("msg") == msg:
                return event
        raise AssertionError(f"no {msg!r} log line; saw {self.log}")

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process, then for its reader to reach EOF: the last log lines are in
        `lines` only once the reader has read them, which can be after the process has exited."""
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def health(self) -> str:
        with grpc.insecure_channel(self.grpc_addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _drain_queue(gw: GatewayProcess) -> list[dict]:
    out = []
    while not gw.lines.empty():
        out.append(gw.lines.get())
    return out


def _post_quietly(url: str, body: bytes) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30).read()
    except Exception:
        pass


@pytest.fixture
def stub():
    s = StubThread()
    yield s
    s.stop()


def test_flags_cover_the_launchers_contract():
    import argparse
    parser = argparse.ArgumentParser()
    flags_from_dataclass(CONFIG_CLASS, parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--listen", "--http-port", "--host", "--tokenizer-addr", "--model-name", "--max-request-bytes",
            "--drain-timeout-s", "--log-level"} <= flags


def test_health_follows_readiness_and_sigterm_drains_a_stream(stub):
    gw = GatewayProcess(stub.port, "--drain-timeout-s", "20")
    try:
        assert gw.health() == "NOT_SERVING" and gw.get("/ready") == 503 and gw.get("/health") == 200
        stub.serve()
        gw.wait_log("ready")
        assert gw.health() == "SERVING" and gw.get("/ready") == 200
        stub.stub.mode, stub.stub.slow_tokens = "slow", 20  # a 1 s stream
        body = json.dumps({"model": "stub", "prompt": "x", "max_tokens": 4, "stream": True}).encode()
        resp = urllib.request.urlopen(urllib.request.Request(gw.url + "/v1/completions", data=body), timeout=30)
        assert resp.readline().startswith(b"data: ")
        gw.proc.send_signal(signal.SIGTERM)
        gw.wait_log("draining")
        assert gw.health() == "NOT_SERVING"
        rest = resp.read().decode()  # the in-flight stream runs to its end during the drain
        assert rest.count("data: ") == 21 and rest.endswith("data: [DONE]\n\n")
        assert not stub.stub.cancelled.is_set()
        assert gw.proc.wait(timeout=40) == 0
        gw.wait_log("stopped")
    finally:
        gw.kill()


@pytest.mark.parametrize("streaming", [True, False])
def test_sigterm_cancels_requests_past_the_deadline(stub, streaming):
    stub.serve()
    gw = GatewayProcess(stub.port, "--drain-timeout-s", "1")
    try:
        gw.wait_log("ready")
        # a 10-minute stream: the gateway exits before its end only if the drain deadline cancels it
        stub.stub.mode, stub.stub.slow_tokens = "slow", 12_000
        body = json.dumps({"model": "stub", "prompt": "x", "max_tokens": 32, "stream": streaming}).encode()
        if streaming:
            resp = urllib.request.urlopen(urllib.request.Request(gw.url + "/v1/completions", data=body), timeout=30)
            resp.readline()
        else:
            pending = threading.Thread(target=_post_quietly, args=(gw.url + "/v1/completions", body), daemon=True)
            pending.start()
            end = time.monotonic() + 30
            while not stub.stub.requests:  # in flight: the gateway has called the backend
                assert time.monotonic() < end, "the request never reached the backend"
                time.sleep(0.02)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.wait_exit(timeout=120) == 0  # drain deadline 1 s, then cancel: long before the stream's end
        events = gw.log + _drain_queue(gw)
        cancelling = [e for e in events if e.get("msg") == "cancelling requests still running"]
        assert len(cancelling) == 1 and cancelling[0].get("reason") == "drain deadline", events
        assert stub.run(asyncio.wait_for(stub.stub.cancelled.wait(), 30)) is True  # the gRPC call was cancelled
        if streaming:  # cut off, yet a clean end: an abort chunk, then [DONE]
            last, done = resp.read().decode().strip().split("\n\n")[-2:]
            assert json.loads(last[len("data: "):])["choices"][0]["finish_reason"] == "abort"
            assert done == "data: [DONE]"
    finally:
        gw.kill()


def test_the_listening_url_is_one_a_local_client_can_use():
    from services.gateway.main import http_url
    assert http_url("127.0.0.1", 8123) == "http://127.0.0.1:8123"
    assert http_url("0.0.0.0", 8123) == "http://127.0.0.1:8123"
    assert http_url("::", 80) == "http://[::1]:80" and http_url("::1", 80) == "http://[::1]:80"
    assert http_url("localhost", 1) == "http://localhost:1"
