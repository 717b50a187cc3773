"""`radixmesh up --replicas 2`: two real replicas (SmolLM2-135M) behind the router and the gateway.
Affinity with the real prefix cache, /admin over HTTP, and a clean stop that leaves nothing."""
from __future__ import annotations

import json
import time
import urllib.request

from protos.radixmesh.v1 import (kvstore_pb2, kvstore_pb2_grpc, router_pb2, router_pb2_grpc, tokenizer_pb2,
                                 tokenizer_pb2_grpc)
from tests.integration.mesh_harness import SMALL_MESH, Mesh, collect, greedy

SYSTEM = ("You are the support assistant of a small bakery. You answer questions about bread, opening "
          "hours, prices and allergies. Keep answers short and friendly. ") * 4


def ask(stub, question: str) -> dict:
    conv = tokenizer_pb2.Conversation(messages=[tokenizer_pb2.ChatMessage(role="system", content=SYSTEM),
                                                tokenizer_pb2.ChatMessage(role="user", content=question)])
    return collect(stub.Generate(tokenizer_pb2.GenerateTextRequest(conversation=conv, sampling=greedy(3)),
                                 timeout=120))


def http(method: str, url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_two_replicas_behind_the_router_keep_prefix_affinity():
    mesh = Mesh("--replicas", "2", *SMALL_MESH, "--health-interval-s", "0.2", "--load-interval-s", "0.2",
                gateway=True)
    try:
        mesh.wait_ready()
        assert {"router", "tokenizer-0", "tokenizer-1", "worker-1", "gateway"} <= set(mesh.addresses)
        stub = tokenizer_pb2_grpc.TokenizerStub(mesh.channel("router"))
        results = [ask(stub, f"Question number {i}: do you sell rye bread?") for i in range(5)]
        assert all(r[0]["finish"] is not None for r in results)
        assert results[-1][0]["usage"][2] > 100  # cached tokens: the system prompt was reused
        admin = router_pb2_grpc.RouterStub(mesh.channel("router"))
        listing = {r.address: r for r in admin.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas}
        routed = sorted(r.routed for r in listing.values())
        assert routed == [0, 5], listing  # one replica took the whole shared prefix
        home = next(r for r in listing.values() if r.routed)
        assert home.routed_by_match == 4
        with mesh.channel(next(n for n in mesh.addresses if mesh.addresses[n] == home.address)) as ch:
            load = tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(tokenizer_pb2.GetLoadRequest(), timeout=5)
        assert load.cache_hit_rate > 0.6, load  # the replica's own scheduler counters

        url = next(e for e in reversed(mesh.log) if e.get("msg") == "ready")["url"]
        status, body = http("GET", f"{url}/admin/replicas")
        assert status == 200 and body["policy"] == "cache_aware"
        assert {r["state"] for r in body["replicas"]} == {"healthy"}
        status, body = http("POST", f"{url}/admin/replicas/{home.address}/drain")
        assert body["state"] == "draining"
        after = ask(stub, "Question after the drain: is there gluten-free bread?")[0]
        assert after["finish"] is not None
        # The other replica never saw the system prompt: its KV came from the kvstore that
        # `--replicas 2` starts and every worker writes through to (issue 7).
        assert after["usage"][2] > 0, after
        listing = {r.address: r for r in admin.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas}
        assert listing[home.address].routed == 5 and sum(r.routed for r in listing.values()) == 6
        assert http("POST", f"{url}/admin/replicas/{home.address}/resume")[1]["state"] == "healthy"
        assert mesh.stop() == 0
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()


def test_round_robin_replicas_reuse_each_others_prefixes_through_the_kvstore():
    """Routing ignores prefixes here; the store started by `--replicas 2` still serves replica B
    the system prompt replica A computed (issue 7)."""
    mesh = Mesh("--replicas", "2", "--policy", "round_robin", *SMALL_MESH, "--health-interval-s", "0.2")
    try:
        mesh.wait_ready()
        assert "kvstore" in mesh.addresses
        stub = tokenizer_pb2_grpc.TokenizerStub(mesh.channel("router"))
        first = ask(stub, "Question 0: when do you open?")[0]
        # Write-through is asynchronous (the worker's put_nowait): a request that arrives while
        # the last pages are still on their way finds fewer. Wait for the prompt's full pages.
        store = kvstore_pb2_grpc.KVStoreStub(mesh.channel("kvstore"))
        deadline = time.monotonic() + 30
        while store.Stats(kvstore_pb2.KVStoreStatsRequest(), timeout=5).pages_stored < first["usage"][0] // 16:
            assert time.monotonic() < deadline, "replica A's pages never reached the store"
            time.sleep(0.05)
        second = ask(stub, "Question 1: when do you open?")[0]
        admin = router_pb2_grpc.RouterStub(mesh.channel("router"))
        routed = [r.routed for r in admin.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas]
        assert routed == [1, 1]  # one request each: the second replica saw the prompt first here
        assert first["usage"][2] == 0 and second["usage"][2] > 100, (first, second)
        assert mesh.stop() == 0
    finally:
        mesh.kill_all()
