"""`radixmesh up` when a worker hangs or dies: the scheduler's progress watchdog and request
deadline (a real SIGSTOP on the worker), `--restart-on-failure` (a real SIGKILL), and one
Prometheus port per service with `--metrics-port N`. Each mesh is a real launcher process."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import tokenizer_pb2
from services.launcher.up import UpConfig, metrics_ports, plan
from tests.integration.mesh_harness import SMALL_MESH, Mesh, collect, finish_reason, greedy, stats

WAIT_S = 300  # an upper bound for things that happen at any speed; never reached when they do


def _wait_until(check, what: str, timeout: float = WAIT_S, mesh: Mesh | None = None):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert mesh is None or mesh.proc.poll() is None, f"the launcher exited while waiting for {what}"
        assert time.monotonic() < end, f"{what}: not within {timeout}s"
        time.sleep(0.1)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return -1


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def _listening(mesh: Mesh) -> dict[str, dict]:
    return {e["service"]: e for e in mesh.log if e.get("msg") == "listening"}


class _SSE:
    """A streaming /v1/completions call; `events()` yields the decoded `data:` payloads."""

    def __init__(self, url: str, body: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()

    def events(self):
        for raw in self.resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


# --- the watchdog and the request deadline: SIGSTOP on the worker ---------------------------------

def test_a_stopped_worker_flips_readiness_and_in_flight_requests_end_at_their_deadline():
    mesh = Mesh(*SMALL_MESH, "--step-stall-floor-s", "3", "--step-stall-per-token-s", "0.05",
                "--request-timeout-s", "40", gateway=True)
    stopped = False
    try:
        mesh.wait_ready()
        url = f"http://127.0.0.1:{_listening(mesh)['gateway']['http_port']}"
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
        _wait_until(lambda: _http_status(url + "/ready") == 200, "/ready 200", mesh=mesh)
        stub, scheduler = mesh.tokenizer(), mesh.addresses["scheduler"]

        # Two requests in flight (each has its first tokens) when the worker stops: SSE and gRPC.
        sse = _SSE(url, {"model": model, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                         "ignore_eos": True})
        sse_events = sse.events()
        first_sse = next(sse_events)
        assert "choices" in first_sse, first_sse
        call = stub.Generate(tokenizer_pb2.GenerateTextRequest(
            text="A long story:", sampling=greedy(300, ignore_eos=True)), timeout=WAIT_S)
        first = next(call)
        assert first.WhichOneof("event") == "chunk", first
        worker = mesh.pids["worker"]
        os.kill(worker, signal.SIGSTOP)
        stopped = True

        # The watchdog: the scheduler's health, the tokenizer's Ready and the gateway's /ready.
        _wait_until(lambda: _health(scheduler) == health_pb2.HealthCheckResponse.NOT_SERVING,
                    "scheduler NOT_SERVING", mesh=mesh)
        ready = stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10)
        assert not ready.ready
        assert any("not making progress" in s.detail for s in ready.stages), ready
        _wait_until(lambda: _http_status(url + "/ready") == 503, "/ready 503", mesh=mesh)
        with pytest.raises(grpc.RpcError) as refused:  # new work is refused, not left hanging
            list(stub.Generate(tokenizer_pb2.GenerateTextRequest(text="new", sampling=greedy(4)), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "has not answered step" in refused.value.details()

        # The deadline ends both in-flight requests while the worker is still stopped.
        rest = list(call)
        assert rest[-1].WhichOneof("event") == "error", rest[-1]
        assert rest[-1].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], rest[-1]
        assert "--request-timeout-s=40s" in rest[-1].error.message
        sse_rest = list(sse_events)
        assert sse_rest and sse_rest[-1].get("error", {}).get("code") == "deadline_exceeded", sse_rest[-1:]
        assert psutil.Process(worker).status() == psutil.STATUS_STOPPED

        os.kill(worker, signal.SIGCONT)
        stopped = False
        _wait_until(lambda: _http_status(url + "/ready") == 200, "/ready 200 after SIGCONT", mesh=mesh)
        assert _health(scheduler) == health_pb2.HealthCheckResponse.SERVING
        after = collect(stub.Generate(tokenizer_pb2.GenerateTextRequest(
            text="The quick brown fox", sampling=greedy(8, ignore_eos=True)), timeout=WAIT_S))
        assert finish_reason(after[0]["finish"]) == "length" and len(after[0]["token_ids"]) == 8
        # The timed-out requests were aborted in the core: nothing runs, none waits (KV freed;
        # --check-invariants checks the accounting after every step).
        s = _wait_until(lambda: (s := stats(mesh)).num_running == 0 and s.num_waiting == 0 and s,
                        "the aborted requests released", mesh=mesh)
        assert s.aborted >= 2 and s.kv_pages_used == s.kv_pages_cached, s  # only the prefix cache holds KV
        sse.conn.close()
        assert mesh.stop() == 0
        assert mesh.leftover_children() == []
    finally:
        if stopped:
            os.kill(mesh.pids["worker"], signal.SIGCONT)
        mesh.kill_all()


# --- --metrics-port N and --restart-on-failure ---------------------------------------------------

def test_metrics_ports_are_consecutive_in_start_order_and_bounded():
    one = plan(1, False, True)
    assert metrics_ports(one, 9100) == {"worker": 9100, "scheduler": 9101, "detokenizer": 9102, "tokenizer": 9103}
    assert metrics_ports(one, 0) == dict.fromkeys(["worker", "scheduler", "detokenizer", "tokenizer"], 0)
    assert metrics_ports(one, None) == {}
    fleet = metrics_ports(plan(2, False, True, kvstore=True), 9000)
    assert list(fleet) == ["kvstore", "worker-0", "scheduler-0", "detokenizer-0", "tokenizer-0",
                           "worker-1", "scheduler-1", "detokenizer-1", "tokenizer-1", "router"]
    assert list(fleet.values()) == list(range(9000, 9010))
    with pytest.raises(ValueError, match="no room for 4 ports"):
        metrics_ports(one, 65533)
    for bad, message in (({"metrics_port": 70000}, r"--metrics-port must be in \[0, 65535\], got 70000"),
                         ({"restart_max_tries": 0}, r"--restart-max-tries must be >= 1 .* got 0 and"),
                         ({"restart_backoff_s": -1.0}, r"--restart-backoff-s >= 0, got \d+ and -1.0")):
        with pytest.raises(ValueError, match=message):
            UpConfig(**bad)


def _free_port_run(n: int) -> int:
    """A first port of n consecutive ports that are free now."""
    for base in range(20000 + os.getpid() % 20000, 60000, 97):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def restartable():
    base = _free_port_run(4)
    mesh = Mesh(*SMALL_MESH, "--metrics-port", str(base), "--restart-on-failure", "--restart-backoff-s", "0.5")
    mesh.metrics_base = base
    try:
        yield mesh.wait_ready()
    finally:
        mesh.kill_all()


def test_metrics_port_gives_every_service_its_own_port(restartable):
    mesh, base = restartable, restartable.metrics_base
    listening = _listening(mesh)
    expected = {"worker": base, "scheduler": base + 1, "detokenizer": base + 2, "tokenizer": base + 3}
    assert {name: listening[name]["metrics_port"] for name in expected} == expected
    for name, port in expected.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert r.status == 200 and b"# TYPE" in r.read(), name
    line = _wait_until(lambda: next((l for l in mesh.stdout if l.startswith("metrics:")), None),
                       "the metrics line", mesh=mesh)
    for name, port in expected.items():
        assert f"{name} http://127.0.0.1:{port}/metrics" in line, line


def test_restart_on_failure_brings_a_killed_worker_back_on_its_address(restartable):
    mesh = restartable
    stub = mesh.tokenizer()
    request = tokenizer_pb2.GenerateTextRequest(text="The quick brown fox", sampling=greedy(8, ignore_eos=True))
    before = collect(stub.Generate(request, timeout=WAIT_S))[0]
    old = mesh.pids["worker"]
    os.kill(old, signal.SIGKILL)
    restarted = mesh.wait_log(lambda e: e.get("service") == "launcher" and e.get("msg") == "restarted"
                              and e.get("child") == "worker", WAIT_S)
    mesh.pids["worker"] = int(restarted["pid"])  # for kill_all
    assert restarted["pid"] != old and restarted["address"] == mesh.addresses["worker"]
    # The scheduler flipped its health with the lost stream, and back once it reconnected.
    again = lambda e: e.get("service") == "scheduler" and e.get("msg") == "ready again"  # noqa: E731
    if not any(again(e) for e in mesh.log):  # it may come before or after the launcher's line
        mesh.wait_log(again, WAIT_S)
    flips = [e["msg"] for e in mesh.log if e.get("service") == "scheduler" and e.get("msg") in
             ("not ready", "ready again")]
    assert flips[-2:] == ["not ready", "ready again"], flips
    assert _health(mesh.addresses["scheduler"]) == health_pb2.HealthCheckResponse.SERVING
    _wait_until(lambda: stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10).ready, "Ready", mesh=mesh)
    after = collect(stub.Generate(request, timeout=WAIT_S))[0]
    assert after["token_ids"] == before["token_ids"] and finish_reason(after["finish"]) == "length"
    assert mesh.proc.poll() is None  # the launcher kept the mesh
    # The restarted worker kept its metrics port too.
    worker_lines = [e for e in mesh.log if e.get("service") == "worker" and e.get("msg") == "listening"]
    assert [e["metrics_port"] for e in worker_lines] == [mesh.metrics_base] * 2
    assert mesh.stop() == 0
    assert mesh.leftover_children() == []
