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


def _step_seconds(stub, streams: int, tokens: int = 12) -> float:
    """This machine's decode step time now, `streams` at once: the slowest stream's time from
    its first event to its end, per token after the first."""
    spans: list[float] = []

    def one(i: int) -> None:
        first = None
        for _ in stub.Generate(tokenizer_pb2.GenerateTextRequest(
                text=f"Warm-up {i}:", sampling=greedy(tokens, ignore_eos=True)), timeout=600):
            first = first or time.monotonic()
        spans.append(time.monotonic() - first)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == streams, "a warm-up stream failed"
    return max(spans) / (tokens - 1)


def test_sigterm_under_8_streams_drains_refuses_new_work_and_leaves_nothing():
    # Token counts come from the step time measured here, so that at any machine speed the short
    # streams finish well within the drain deadline and the long ones cannot (a 4x margin each
    # way, for load that changes). KV for all 8 at full length: no retraction.
    drain_s = 8.0
    mesh = Mesh(*SMALL_MESH, "--kv-cache-bytes", str(256 << 20), drain_timeout_s=drain_s)
    try:
        mesh.wait_ready()
        stub = mesh.tokenizer()
        step_s = _step_seconds(stub, 8)
        s = mesh.scheduler().GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        page = mesh.scheduler().GetInfo(worker_pb2.GetInfoRequest(), timeout=10).page_size
        window = drain_s - min(2.0, 0.25 * drain_s)  # the services abort what is left this long after SIGTERM
        n_short = max(1, min(8, int(window / (4 * step_s))))
        # Per long stream: a quarter of the pool, less a short stream, two prompts and page rounding.
        room = s.kv_pages_total * page // 4 - n_short - 2 * page - 32
        n_long = min(room, int(4 * drain_s / step_s) + 1)
        long_cut = n_long * step_s > 2 * drain_s  # else this machine is too fast for the KV pool: noted below
        results: list = [None] * 8
        started = [threading.Event() for _ in range(8)]

        def consume(i: int) -> None:
            # Even ones are short and finish; odd ones cannot finish within the drain deadline.
            n = n_short if i % 2 == 0 else n_long
            events = []
            try:
                for ev in stub.Generate(tokenizer_pb2.GenerateTextRequest(
                        text=f"Chapter {i}. It was a dark night", sampling=greedy(n, ignore_eos=True)), timeout=600):
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
            assert ev.wait(600)
        mesh.proc.send_signal(signal.SIGTERM)
        tokenizer = mesh.addresses["tokenizer"]
        while _health(tokenizer) == health_pb2.HealthCheckResponse.SERVING:  # then draining, or gone
            assert mesh.proc.poll() is None
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(tokenizer_pb2.GenerateTextRequest(text="late", sampling=greedy(4)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(timeout=600)
        reasons = []
        for i, events in enumerate(results):
            assert isinstance(events, list), f"stream {i} failed: {events}"
            assert events[-1].WhichOneof("event") == "finish", (i, events[-1])
            reasons.append(finish_reason(events[-1].finish))
        assert all(reasons[i] == "length" for i in range(0, 8, 2)), reasons
        assert all(reasons[i] in ("abort", "length") for i in range(1, 8, 2)), reasons
        if long_cut:
            assert "abort" in reasons, (reasons, step_s)  # cut at the deadline, with a proper finish
        else:
            print(f"steps of {step_s:.4f}s: {n_long} tokens (what the KV holds) may finish within the drain")
        # 0: every stage stopped by its deadline (the launcher SIGKILLs a late child, and exits 1).
        assert mesh.proc.wait(timeout=600) == 0
        assert mesh.leftover_children() == []
    finally:
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
