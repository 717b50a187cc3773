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

from protos.radixmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc, worker_pb2
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
    # Four short streams finish within the drain; four long ones cannot, at any machine speed: once
    # the short ones have ended, the worker is stopped (SIGSTOP: no step runs, no stream breaks) until
    # the tokenizer's drain deadline has aborted what is left, then resumed so the aborts end the
    # streams with a proper finish. KV for all 8 at full length: no retraction.
    drain_s = 20.0
    mesh = Mesh(*SMALL_MESH, "--kv-cache-bytes", str(256 << 20), drain_timeout_s=drain_s)
    worker, stopped = None, False
    try:
        mesh.wait_ready()
        stub = mesh.tokenizer()
        s = mesh.scheduler().GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        page = mesh.scheduler().GetInfo(worker_pb2.GetInfoRequest(), timeout=10).page_size
        n_short = 4
        # Per long stream: a quarter of the pool, less a short stream, two prompts and page rounding
        # (over a thousand tokens: still running long after the short ones have ended).
        n_long = s.kv_pages_total * page // 4 - n_short - 2 * page - 32
        assert n_long > 50 * n_short, n_long
        results: list = [None] * 8
        started = [threading.Event() for _ in range(8)]

        def consume(i: int) -> None:
            # Even ones are short and finish; odd ones are cut at the drain deadline.
            n = n_short if i % 2 == 0 else n_long
            events = []
            try:
                for ev in stub.Generate(tokenizer_pb2.GenerateTextRequest(
                        text=f"Chapter {i}. It was a dark night", sampling=greedy(n, ignore_eos=True)), timeout=300):
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
        mesh.proc.send_signal(signal.SIGTERM)
        tokenizer = mesh.addresses["tokenizer"]
        end = time.monotonic() + 60
        while _health(tokenizer) == health_pb2.HealthCheckResponse.SERVING:  # then draining, or gone
            assert mesh.proc.poll() is None
            assert time.monotonic() < end, "the tokenizer still SERVING 60 s after SIGTERM"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(tokenizer_pb2.GenerateTextRequest(text="late", sampling=greedy(4)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for i in range(0, 8, 2):  # the short ones end within the drain
            threads[i].join(timeout=120)
            assert not threads[i].is_alive()
        worker = mesh.pids["worker"]
        os.kill(worker, signal.SIGSTOP)
        stopped = True
        # the tokenizer's deadline (drain_s less its margin) comes while no long stream can progress
        aborting = mesh.wait_log(lambda e: e.get("service") == "tokenizer"
                                 and e.get("msg") == "drain: aborting requests", timeout=drain_s + 120)
        assert aborting.get("requests") == 4, aborting
        os.kill(worker, signal.SIGCONT)
        stopped = False
        for t in threads:
            t.join(timeout=120)
        reasons = []
        for i, events in enumerate(results):
            assert isinstance(events, list), f"stream {i} failed: {events}"
            assert events[-1].WhichOneof("event") == "finish", (i, events[-1])
            reasons.append(finish_reason(events[-1].finish))
        assert reasons == ["length", "abort"] * 4, reasons  # the long ones cut at the deadline, with a proper finish
        # 0: every stage stopped by its deadline (the launcher SIGKILLs a late child, and exits 1).
        assert mesh.proc.wait(timeout=120) == 0, "".join(mesh.raw_stderr[-40:])
        assert mesh.leftover_children() == []
    finally:
        if stopped:
            os.kill(worker, signal.SIGCONT)
        mesh.kill_all()


def test_a_killed_child_stops_the_mesh_and_is_named():
    mesh = Mesh(*SMALL_MESH, gateway=True)
    try:
        mesh.wait_ready()
        assert set(mesh.pids) == {*SERVICES, "gateway"}
        os.kill(mesh.pids["worker"], signal.SIGKILL)
        code = mesh.proc.wait(timeout=300)
        assert code != 0
        end = time.monotonic() + 60  # the reader thread reads the launcher's last lines after its exit
        while "worker died (killed by SIGKILL" not in "".join(mesh.raw_stderr):
            assert time.monotonic() < end, "".join(mesh.raw_stderr[-20:])
            time.sleep(0.1)
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()


def test_worker_loss_fails_open_requests_and_the_scheduler_reconnects():
    """Services started one by one (no launcher, which would stop everything): the worker dies
    mid-stream and a new one comes up on the same port."""
    worker_flags = ("--kv-cache-bytes", str(32 << 20), "--max-requests", "16")
    services = [Service("worker", *worker_flags)]
    worker = services[0]
    try:
        services.append(sched := Service("scheduler", "--worker-addr", worker.address, "--check-invariants"))
        services.append(detok := Service("detokenizer", "--scheduler-addr", sched.address))
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
                assert time.monotonic() < end, "the scheduler did not reconnect to the new worker within 300 s"
                time.sleep(0.5)
            after = collect(stub.Generate(request, timeout=60))[0]
            assert after["text"] == before["text"] and after["token_ids"] == before["token_ids"]
            assert stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10).ready
    finally:
        for service in reversed(services):
            service.stop()
