"""The router as a real process in front of model-free replicas (tests/doubles/fake_replica.py,
each its own process): affinity, balance, faults (SIGKILL, breaker, retry bound), drain, /admin."""
from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections import Counter

import grpc
import pytest

from protos.radixmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v1 import tokenizer_pb2_grpc
from tests.doubles.procs import Proc

FAST = ["--health-interval-s", "0.2", "--health-timeout-s", "0.5", "--load-interval-s", "0.2", "--metrics-port", "0"]


def system(tenant) -> str:
    return f"You are a helpful assistant for tenant {tenant}. " * 12


def request(text: str, tokens: int = 4) -> pb.GenerateTextRequest:
    return pb.GenerateTextRequest(rid=uuid.uuid4().hex, text=text,
                                  sampling=common_pb2.SamplingParams(max_new_tokens=tokens))


def run(stub, text: str, tokens: int = 4) -> dict:
    """One request: who served it (first chunk's text), event kinds, the error if any."""
    out = {"served_by": None, "kinds": [], "error": None, "rpc_error": None}
    try:
        for event in stub.Generate(request(text, tokens), timeout=60):
            kind = event.WhichOneof("event")
            out["kinds"].append(kind)
            if kind == "chunk" and out["served_by"] is None:
                out["served_by"] = event.chunk.text
            if kind == "error":
                out["error"] = event.error
    except grpc.RpcError as e:
        out["rpc_error"] = e.code()
    return out


def run_concurrently(stub, texts: list[str], tokens: int) -> list[dict]:
    results: list[dict] = [{}] * len(texts)

    def one(i: int) -> None:
        results[i] = run(stub, texts[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join(90)
    return results


def replicas(channel) -> dict[str, router_pb2.ReplicaStatus]:
    listing = router_pb2_grpc.RouterStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
    return {r.address: r for r in listing.replicas}


def wait_state(channel, address: str, state: str, timeout: float = 20) -> router_pb2.ReplicaStatus:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = replicas(channel).get(address)
        if r is not None and r.state == state:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{address} never became {state}: {replicas(channel).get(address)}")


@pytest.fixture
def fleet3(request):
    """Three fake replicas (a, b, c) behind a router; flags per test via indirect params."""
    replica_flags, router_flags = getattr(request, "param", ([], []))
    procs = [Proc.fake_replica(name, *replica_flags) for name in "abc"]
    router = Proc.router([p.address for p in procs], *FAST, *router_flags)
    router.wait_event("serving", 30)
    channel = grpc.insecure_channel(router.address)
    yield procs, router, channel, tokenizer_pb2_grpc.TokenizerStub(channel)
    channel.close()
    for p in [router, *procs]:
        p.__exit__()


def test_affinity_shared_prefix_lands_on_one_replica_and_its_hit_rate_rises(fleet3):
    procs, router, channel, stub = fleet3
    served = [run(stub, system(1) + f"question {i}?")["served_by"] for i in range(8)]
    assert len(set(served)) == 1, served
    other = [run(stub, system(2) + f"question {i}?")["served_by"] for i in range(4)]
    assert len(set(other)) == 1
    home = next(p for p in procs if p.name == f"replica {served[0]}")
    with grpc.insecure_channel(home.address) as ch:
        load = tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.cache_hit_rate > 0.7, load
    status = replicas(channel)[home.address]
    assert status.routed_by_match >= 7 and status.tree_chars > 0
    fleet_load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)  # the router's own GetLoad: the sum
    assert fleet_load.cache_query_tokens > 0
    port = router.events("listening")[0]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert (f'radixmesh:router_requests_routed_total{{decision="match",model_name="fake",'
            f'replica="{home.address}"}} {float(status.routed_by_match)}') in text, text
    assert "radixmesh:router_circuit_state" in text and "radixmesh:router_replica_cache_hit_rate" in text


@pytest.mark.parametrize("fleet3", [(["--token-delay-s", "0.05"],
                                     ["--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5"])],
                         indirect=True)
def test_balance_hot_prefix_overflows_past_the_thresholds(fleet3):
    procs, router, channel, stub = fleet3
    run(stub, system("hot") + "warm-up")
    results = run_concurrently(stub, [system("hot") + f"q{i}" for i in range(30)], tokens=30)
    counts = Counter(r["served_by"] for r in results)
    assert all(r["kinds"][-1] == "finish" for r in results)
    assert set(counts) == {"a", "b", "c"}, counts  # the hot prefix overflowed to every replica
    low = min(counts.values())
    assert max(counts.values()) <= max(low + 4, 1.5 * low) + 2, counts  # share + thresholds (+1 stale load)
    by_load = sum(r.routed_by_load for r in replicas(channel).values())
    assert by_load >= 2


@pytest.mark.parametrize("fleet3", [(["--token-delay-s", "0.1", "--capacity", "2"], ["--max-retries", "2"])],
                         indirect=True)
def test_sigkill_one_of_three_under_load(fleet3):
    procs, router, channel, stub = fleet3
    texts = [f"distinct prompt {i} " * 10 for i in range(24)]
    results: list[dict] = []
    runner = threading.Thread(target=lambda: results.extend(run_concurrently(stub, texts, tokens=20)))
    runner.start()
    time.sleep(1.0)  # every replica: 2 streaming, the rest waiting (not streaming)
    status = replicas(channel)
    victim = max(procs, key=lambda p: status[p.address].in_flight)
    assert status[victim.address].in_flight >= 4
    victim.kill()
    runner.join(120)
    assert len(results) == len(texts)
    name = victim.name.split()[-1]
    for r in results:
        if r["served_by"] == name:  # was streaming from the victim: ends with one clean error event
            assert r["kinds"][-1] == "error" and r["error"].code == grpc.StatusCode.UNAVAILABLE.value[0], r
        else:  # had not started there (or never went there): completed on another replica
            assert r["rpc_error"] is None and r["kinds"][-1] == "finish", r
    assert sum(r["served_by"] == name for r in results) <= 2  # its capacity: the rest were retried
    assert wait_state(channel, victim.address, "ejected").ejections == 1
    victim.restart()
    wait_state(channel, victim.address, "healthy")
    assert {run(stub, f"after restart {i}")["kinds"][-1] for i in range(6)} == {"finish"}


@pytest.mark.parametrize("fleet3", [([], ["--policy", "round_robin", "--breaker-failures", "2",
                                          "--breaker-cooldown-s", "60", "--max-retries", "2"])], indirect=True)
def test_always_failing_replica_opens_its_breaker(fleet3):
    procs, router, channel, stub = fleet3
    bad = Proc.fake_replica("bad", "--fail", "always")
    try:
        router_pb2_grpc.RouterStub(channel).AddReplica(router_pb2.AddReplicaRequest(address=bad.address), timeout=5)
        wait_state(channel, bad.address, "healthy")  # health cannot see it is broken
        results = [run(stub, f"prompt {i}") for i in range(12)]
        assert all(r["kinds"][-1] == "finish" for r in results)  # retried elsewhere, none lost
        status = replicas(channel)
        assert status[bad.address].circuit == "open" and status[bad.address].failures == 2
        assert sum(s.routed for s in status.values()) == 12 + 2  # one retry per failed attempt
    finally:
        bad.__exit__()


def test_attempts_per_request_are_bounded_by_max_retries():
    bad = [Proc.fake_replica(f"bad{i}", "--fail", "always") for i in range(2)]
    router = Proc.router([b.address for b in bad], *FAST, "--max-retries", "2", "--breaker-failures", "100",
                         "--retry-backoff-s", "0.01")
    try:
        router.wait_event("serving", 30)
        with grpc.insecure_channel(router.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            for _ in range(3):
                assert run(stub, "doomed")["rpc_error"] == grpc.StatusCode.UNAVAILABLE
            assert sum(s.routed for s in replicas(channel).values()) == 3 * (1 + 2)
    finally:
        for p in [router, *bad]:
            p.__exit__()


@pytest.mark.parametrize("fleet3", [(["--token-delay-s", "0.05"], [])], indirect=True)
def test_drain_sends_no_new_work_and_lets_in_flight_finish(fleet3):
    procs, router, channel, stub = fleet3
    admin = router_pb2_grpc.RouterStub(channel)
    target = procs[0]
    first: list[dict] = []
    runner = threading.Thread(target=lambda: first.extend(
        run_concurrently(stub, [f"long {i} " * 10 for i in range(9)], tokens=30)))
    runner.start()
    time.sleep(0.5)
    in_flight = replicas(channel)[target.address].in_flight
    assert in_flight >= 1
    assert admin.DrainReplica(router_pb2.DrainReplicaRequest(address=target.address), timeout=5).state == "draining"
    routed_before = replicas(channel)[target.address].routed
    later = run_concurrently(stub, [f"after drain {i} " * 10 for i in range(9)], tokens=2)
    runner.join(60)
    assert all(r["kinds"][-1] == "finish" for r in first + later)  # its in-flight ones completed
    assert "a" not in {r["served_by"] for r in later}
    assert replicas(channel)[target.address].routed == routed_before
    removed = admin.RemoveReplica(router_pb2.RemoveReplicaRequest(address=target.address), timeout=10)
    assert removed.state == "removed" and removed.in_flight == 0
    assert target.address not in replicas(channel)
