"""TLS and mTLS on the internal gRPC services, over loopback, with certificates made by
scripts/make_test_ca.sh: real `radixmesh serve` processes (kvstore, tokenizer, router)
refuse a client without a certificate in the handshake and answer one with it; the
router, itself an mTLS client, admits a replica only over mTLS; TLS without client
certificates answers any CA-verifying client. A gateway process in front of an mTLS replica
reaches it with the client flags and serves its own health port over mTLS; without the CA it
answers 503 and stays up."""
from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import tls
from services.kvstore.client import KVStoreClient
from services.launcher import healthcheck
from tests.doubles.procs import Proc as Double
from tests.integration.mesh_harness import REPO
from tests.integration.test_kvstore_service import SPEC, chain, same

pytestmark = pytest.mark.timeout(180)
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(REPO / "scripts/make_test_ca.sh"), str(root / "fleet")], check=True,
                   capture_output=True)
    subprocess.run(["bash", str(REPO / "scripts/make_test_ca.sh"), str(root / "other")], check=True,
                   capture_output=True)  # a CA the fleet does not trust
    return root


def server_flags(d: Path, mtls: bool) -> list[str]:
    flags = ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key")]
    if mtls:  # servers require client certificates; as clients they present their own
        flags += ["--tls-client-ca", str(d / "ca.pem"), "--tls-ca", str(d / "ca.pem"),
                  "--tls-client-cert", str(d / "server.pem"), "--tls-client-key", str(d / "server.key")]
    return flags


class Proc:
    """One `radixmesh serve NAME` process; its port read from its `listening` line."""

    def __init__(self, name: str, *flags: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", name, "--listen", "127.0.0.1:0",
                                      *flags], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._listening: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if '"listening"' in line:
                self._listening.put(json.loads(line))

    def listening(self, timeout: float = 120) -> dict:
        try:
            event = self._listening.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name} never listened:\n{''.join(self.lines[-20:])}") from None
        self.address = f"127.0.0.1:{event['port']}"
        return event

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def client(d: Path, cert: bool) -> tls.ClientTLS:
    return tls.ClientTLS(str(d / "ca.pem"), str(d / "client.pem") if cert else None,
                         str(d / "client.key") if cert else None)


def health(address: str, settings: tls.ClientTLS | None) -> tuple[str, str]:
    """(the health status name or the error's code name, the error's details)."""
    channel = grpc.secure_channel(address, settings.credentials()) if settings else grpc.insecure_channel(address)
    with channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), ""


def wait_status(address: str, settings: tls.ClientTLS, want: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while (got := health(address, settings)[0]) != want:
        assert time.monotonic() < end, f"{address}: {got}, not {want}"
        time.sleep(0.2)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


async def test_mtls_refuses_clients_without_a_certificate_at_the_handshake(certs: Path, procs: list[Proc]) -> None:
    d = certs / "fleet"
    mtls = server_flags(d, mtls=True)
    kvstore = Proc("kvstore", *mtls)
    tokenizer = Proc("tokenizer", *mtls, "--scheduler-addr", "127.0.0.1:9", "--detokenizer-addr", "127.0.0.1:9")
    procs += [kvstore, tokenizer]
    assert kvstore.listening()["tls"] == "mtls" and tokenizer.listening()["tls"] == "mtls"
    # The router dials its replica (here the kvstore, which answers health) as an mTLS client:
    # it admits it, and so becomes SERVING, only because its own client certificate is accepted.
    router = Proc("router", *mtls, "--replica-addrs", kvstore.address, "--peer-wait-s", "60")
    procs.append(router)
    assert router.listening()["tls"] == "mtls"
    wait_status(router.address, client(d, cert=True), "SERVING")
    wait_status(kvstore.address, client(d, cert=True), "SERVING")
    for p in (kvstore, tokenizer, router):
        code, details = health(p.address, client(d, cert=False))   # verifies the server, has no certificate
        assert code == "UNAVAILABLE", (p.name, code, details)
        assert health(p.address, None)[0] == "UNAVAILABLE"         # plaintext
        assert health(p.address, client(certs / "other", cert=True))[0] == "UNAVAILABLE"  # another CA's
        assert health(p.address, client(d, cert=True))[0] in ("SERVING", "NOT_SERVING")  # the tokenizer waits
    assert healthcheck.check(kvstore.address, settings=client(d, cert=True)) == "SERVING"
    # The kvstore client dials with the process's settings.
    tls.configure_clients(client(d, cert=True))
    kv = KVStoreClient(kvstore.address, SPEC)
    try:
        ids, keys, pages = chain(3)
        assert await kv.put(keys, pages) == 3
        assert all(same(g, p) for g, p in zip(await kv.get(keys), pages))
    finally:
        tls.configure_clients(None)
        await kv.close()
    tls.configure_clients(client(d, cert=False))
    anonymous = KVStoreClient(kvstore.address, SPEC, timeout_s=2.0)
    try:
        assert await anonymous.exists(keys) == 0 and anonymous.counters.failures == 1
    finally:
        tls.configure_clients(None)
        await anonymous.close()


async def test_tls_without_client_certificates_answers_a_ca_verifying_client(certs: Path, procs: list[Proc]) -> None:
    d = certs / "fleet"
    kvstore = Proc("kvstore", *server_flags(d, mtls=False))
    procs.append(kvstore)
    assert kvstore.listening()["tls"] == "tls"
    wait_status(kvstore.address, client(d, cert=False), "SERVING")
    assert health(kvstore.address, None)[0] == "UNAVAILABLE"                       # plaintext
    assert health(kvstore.address, client(certs / "other", cert=False))[0] == "UNAVAILABLE"  # wrong CA
    kv = KVStoreClient(kvstore.address, SPEC)
    tls.configure_clients(client(d, cert=False))
    try:
        ids, keys, pages = chain(2)
        assert await kv.put(keys, pages) == 2 and await kv.exists(keys) == 2
    finally:
        tls.configure_clients(None)
        await kv.close()


def test_plaintext_stays_the_default(procs: list[Proc]) -> None:
    kvstore = Proc("kvstore")
    procs.append(kvstore)
    assert kvstore.listening()["tls"] == "off"
    wait_status(kvstore.address, None, "SERVING")  # type: ignore[arg-type]


async def test_aio_channel_uses_the_configured_settings(certs: Path) -> None:
    """tracing.channel and the other call sites go through tls.aio_channel: plaintext unless configured."""
    d = certs / "fleet"
    server = grpc.aio.server()
    from grpc_health.v1 import health as health_mod
    health_pb2_grpc.add_HealthServicer_to_server(health_mod.aio.HealthServicer(), server)
    port = tls.add_port(server, "127.0.0.1:0", tls.ServerTLS(str(d / "server.pem"), str(d / "server.key"),
                                                             str(d / "ca.pem")))
    await server.start()
    from services.common import tracing

    async def check() -> str:
        async with tracing.channel(f"localhost:{port}") as ch:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    try:
        assert await check() == "UNAVAILABLE"
        tls.configure_clients(client(d, cert=True))
        assert await check() == "SERVING"  # by name too: the certificate names localhost
    finally:
        tls.configure_clients(None)
        await server.stop(None)
    await asyncio.sleep(0)


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    """GET, or POST `body` as JSON: (status, the JSON answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_ready(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while (got := http(url + "/ready"))[0] != 200:
        assert time.monotonic() < end, f"{url}/ready: {got}"
        time.sleep(0.2)


def test_a_gateway_in_front_of_an_mtls_backend(certs: Path, procs: list[Proc]) -> None:
    d = certs / "fleet"
    mtls = server_flags(d, mtls=True)
    completion = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    with Double.fake_replica("tls", *mtls) as replica:
        gateway = Proc("gateway", *mtls, "--http-port", "0", "--tokenizer-addr", replica.address,
                       "--ready-interval-s", "0.2")
        blind = Proc("gateway", "--http-port", "0", "--tokenizer-addr", replica.address,  # no --tls-ca
                     "--ready-interval-s", "0.2")
        procs += [gateway, blind]
        listening = gateway.listening()
        assert listening["tls"] == "mtls"
        wait_ready(listening["url"])
        status, body = http(listening["url"] + "/v1/completions", completion)  # through the mTLS channel
        assert status == 200 and body["choices"][0]["text"] == "tls.", body
        wait_status(gateway.address, client(d, cert=True), "SERVING")  # its own health port: mTLS
        assert health(gateway.address, client(d, cert=False))[0] == "UNAVAILABLE"
        assert health(gateway.address, None)[0] == "UNAVAILABLE"
        url = blind.listening()["url"]
        status, body = http(url + "/v1/completions", completion)  # the handshake fails: 503, not a crash
        assert status == 503 and "UNAVAILABLE" in body["error"]["message"], body
        status, body = http(url + "/ready")
        assert status == 503 and "does not answer" in body["error"]["message"], body
        assert blind.proc.poll() is None
