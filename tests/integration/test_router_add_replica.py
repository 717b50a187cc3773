"""AddReplica admits only a live replica: the router probes the address's health service first
(with its client TLS settings), so nobody can register an address that does not answer as a
fleet member, and with --tls-ca one without a certificate from the fleet's CA is refused too."""
from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from tests.doubles.procs import Proc
from tests.integration.mesh_harness import REPO
from tests.integration.test_router_fleet import FAST, replicas, wait_state

pytestmark = pytest.mark.timeout(120)


def add(channel, address: str) -> router_pb2.ReplicaStatus:
    return router_pb2_grpc.RouterStub(channel).AddReplica(router_pb2.AddReplicaRequest(address=address), timeout=30)


def refused(channel, address: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        add(channel, address)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    return err.value.details()


def test_add_replica_probes_the_address_before_it_joins():
    with Proc.fake_replica("a") as replica, Proc.router([], *FAST) as router, \
            grpc.insecure_channel(router.address) as channel:
        router.wait_event("serving", 30)
        with Proc.fake_replica("gone") as gone:
            dead = gone.address
        why = refused(channel, dead)
        assert dead in why and "health" in why
        assert list(replicas(channel)) == []  # nothing was registered
        assert add(channel, replica.address).address == replica.address
        wait_state(channel, replica.address, "healthy")


def test_with_tls_a_replica_without_the_fleets_certificate_is_refused(tmp_path: Path):
    subprocess.run(["bash", str(REPO / "scripts/make_test_ca.sh"), str(tmp_path / "fleet")], check=True,
                   capture_output=True)
    with Proc.fake_replica("plaintext") as replica, \
            Proc.router([], *FAST, "--tls-ca", str(tmp_path / "fleet" / "ca.pem")) as router, \
            grpc.insecure_channel(router.address) as channel:
        router.wait_event("serving", 30)
        why = refused(channel, replica.address)  # it answers health, but not over TLS
        assert "health" in why
        assert list(replicas(channel)) == []
