"""`radixmesh up` as a process manager: flag routing, drain on SIGTERM under load, a dead child
stopping the mesh. Each process test starts its own mesh (it ends it)."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.radixmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.launcher.up import route_flags
from tests.integration.mesh_harness import SMALL_MESH, Mesh, Service, collect, finish_reason, greedy

SERVICES = ["worker", "detokenizer", "scheduler", "tokenizer"]


def test_flags_go_to_the_services_that_accept_them():
    routed = route_flags(["--kv-cache-bytes", "1000000", "--max-running-requests=8", "--log-level", "debug",
                          "--no-check-invariants"], SERVICES)
    assert routed["worker"] == ["--kv-cache-bytes", "1000000", "--log-level", "debug"]
    assert routed["scheduler"] == ["--max-running-requests=8", "--log-level", "debug", "--no-check-invariants"]
    assert routed["tokenizer"] == routed["detokenizer"] == ["--log-level", "debug"]
    for bad, message in [(["--nonsense", "1"], "no service accepts --nonsense"),
                         (["--listen", "1.2.3.4:5"], "set by radixmesh up"),
                         (["--worker-addr", "x:1"], "set by radixmesh up"),
                         (["stray"], "unexpected argument")]:
        with pytest.raises(ValueError, match=message):
            route_flags(bad, SERVICES)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def test_sigterm_under_8_streams_drains_refuses_new_work_and_leaves_nothing():
    # KV for all 8 at full length (no retraction); the long ones need >= 10 s at the CPU's best.
    mesh = Mesh(*SMALL_MESH, "--kv-cache-bytes", str(80 << 20), drain_timeout_s=6)
    try:
        mesh.wait_ready()
        stub = mesh.tokenizer()
        results: list = [None] * 8
        started = [threading.Event() for _ in range(8)]

        def consume(i: int) -> None:
            # Even ones are short and finish; odd ones cannot finish within the drain deadline.
            n = 8 if i % 2 == 0 else 400
            events = []
            try:
                for ev in stub.Generate(tokenizer_pb2.GenerateTextRequest(
                        text=f"Chapter {i}. It was a dark night", sampling=greedy(n, ignore_eos=True)), timeout=180):
                    events.append(ev)
                    started[i].set()
                results[i] = events
            except grpc.RpcError as e:
                results[i] = e
                started[i].set()

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(120)
        sigterm_at = time.monotonic()
        mesh.proc.send_signal(signal.SIGTERM)
        tokenizer = mesh.addresses["tokenizer"]
        while _health(tokenizer) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() - sigterm_at < 10
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(tokenizer_pb2.GenerateTextRequest(text="late", sampling=greedy(4)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(timeout=60)
        reasons = []
        for i, events in enumerate(results):
            assert isinstance(events, list), f"stream {i} failed: {events}"
            assert events[-1].WhichOneof("event") == "finish", (i, events[-1])
            reasons.append(finish_reason(events[-1].finish))
        assert all(reasons[i] == "length" for i in range(0, 8, 2)), reasons
        assert all(reasons[i] in ("abort", "length") for i in range(1, 8, 2)), reasons
        assert "abort" in reasons  # the long ones were cut at the deadline, with a proper finish
        assert mesh.proc.wait(timeout=60) == 0
        assert time.monotonic() - sigterm_at < 6 + 15
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()


def test_a_killed_child_stops_the_mesh_and_is_named():
    mesh = Mesh(*SMALL_MESH, gateway=True)
    try:
        mesh.wait_ready()
        assert set(mesh.pids) == {*SERVICES, "gateway"}
        os.kill(mesh.pids["worker"], signal.SIGKILL)
        code = mesh.proc.wait(timeout=60)
        assert code != 0
        time.sleep(0.5)  # let the reader thread collect the last lines
        stderr = "".join(mesh.raw_stderr)
        assert "worker died (killed by SIGKILL" in stderr
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()


def test_worker_loss_fails_open_requests_and_the_scheduler_reconnects():
    """Services started one by one (no launcher, which would stop everything): the worker dies
    mid-stream and a new one comes up on the same port."""
    worker_flags = ("--kv-cache-bytes", str(32 << 20), "--max-requests", "16")
    services = [Service("worker", *worker_flags), Service("detokenizer")]
    worker, detok = services
    try:
        services.append(sched := Service("scheduler", "--worker-addr", worker.address, "--check-invariants"))
        services.append(tok := Service("tokenizer", "--scheduler-addr", sched.address,
                                       "--detokenizer-addr", detok.address))
        tok.wait_serving()
        with grpc.insecure_channel(tok.address) as tch, grpc.insecure_channel(sched.address) as sch:
            stub, sstub = tokenizer_pb2_grpc.TokenizerStub(tch), scheduler_pb2_grpc.SchedulerStub(sch)
            request = tokenizer_pb2.GenerateTextRequest(text="The quick brown fox", sampling=greedy(8))
            before = collect(stub.Generate(request, timeout=60))[0]
            call = stub.Generate(tokenizer_pb2.GenerateTextRequest(
                text="A long story:", sampling=greedy(500, ignore_eos=True)), timeout=120)
            next(call)
            worker.stop(signal.SIGKILL)
            events = list(call)
            assert events[-1].WhichOneof("event") == "error", events[-1]
            assert events[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "worker stream broke" in events[-1].error.message
            assert not sstub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).worker_connected
            assert not stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10).ready
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            services.append(Service("worker", *worker_flags, listen=worker.address))
            end = time.monotonic() + 300
            while not sstub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).worker_connected:
                assert time.monotonic() < end
                time.sleep(0.5)
            after = collect(stub.Generate(request, timeout=60))[0]
            assert after["text"] == before["text"] and after["token_ids"] == before["token_ids"]
            assert stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10).ready
    finally:
        for service in reversed(services):
            service.stop()
