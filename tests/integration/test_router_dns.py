"""`radixmesh serve router --replica-dns NAME:PORT` as a real process: a fake replica found through the
system resolver (localhost), admitted once SERVING, and serving requests through the router."""
from __future__ import annotations

import grpc

from protos.radixmesh.v1 import tokenizer_pb2_grpc
from tests.doubles.procs import Proc
from tests.integration.test_router_fleet import FAST, replicas, run, wait_state


def test_router_discovers_a_replica_by_dns_name():
    with Proc.fake_replica("a") as replica, \
            Proc.router([], "--replica-dns", f"localhost:{replica.port}", "--replica-dns-interval-s", "0.2",
                        *FAST) as router, grpc.insecure_channel(router.address) as channel:
        router.wait_event("serving", 30)
        wait_state(channel, replica.address, "healthy")  # localhost -> 127.0.0.1 (IPv4 first, not twice)
        assert list(replicas(channel)) == [replica.address]
        assert run(tokenizer_pb2_grpc.TokenizerStub(channel), "hello")["served_by"] == "a"
        assert router.events("replica DNS changed")[0]["added"] == [replica.address]
