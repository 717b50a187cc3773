"""Connection limits (services/gateway/connections.py): a silent or half-sent request head is
cut off after --header-timeout-s, an idle keep-alive connection after --idle-timeout-s, a slow
body gets 408 after --body-timeout-s, and a client address holding
--max-connections-per-client connections gets 429 on the next one. Raw sockets against the
app served as main.serve serves it (GuardedSite, aiohttp's keepalive_timeout), in-process
with the FakeBackend, and once through `radixmesh serve gateway` as a process."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from aiohttp import web

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.connections import CONNECTIONS, ConnectionGuard, GuardedSite
from tests.doubles.fake_backend import FakeBackend
from tests.unit.test_gateway_main import GatewayProcess

HEALTH = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"


class Gateway:
    def __init__(self, port: int, guard: ConnectionGuard) -> None:
        self.port, self.guard = port, guard

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def serve():
    runners = []

    async def start(**config) -> Gateway:
        cfg = GatewayConfig(**config)
        app = build_app(cfg, FakeBackend(), monitor_backend=False)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None,
                               keepalive_timeout=cfg.idle_timeout_s)  # as main.serve
        await runner.setup()
        runners.append(runner)
        await GuardedSite(runner, "127.0.0.1", 0, app[CONNECTIONS]).start()
        return Gateway(runner.addresses[0][1], app[CONNECTIONS])

    yield start
    for runner in runners:
        await runner.cleanup()


async def closed_after(reader: asyncio.StreamReader, limit_s: float = 5.0) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, what it sent before)."""
    t0 = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit_s)
    return time.monotonic() - t0, data


async def still_open(reader: asyncio.StreamReader, for_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), for_s) != b""
    except asyncio.TimeoutError:
        return True


async def response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), json.loads(body)


# --- the request head -------------------------------------------------------------------------

async def test_a_silent_connection_is_closed_after_the_header_timeout(serve):
    gw = await serve(header_timeout_s=0.3)
    reader, _ = await gw.connect()
    seconds, data = await closed_after(reader)
    assert data == b"" and 0.25 <= seconds < 2 and gw.guard.timed_out == 1
    assert gw.guard.open == {}  # no longer counted against its client


async def test_half_a_header_is_cut_off_even_when_it_trickles(serve):
    gw = await serve(header_timeout_s=0.4)
    reader, writer = await gw.connect()
    t0 = time.monotonic()
    for byte in HEALTH[:-4]:  # a byte every 50 ms: the deadline runs from the first one
        writer.write(bytes([byte]))
        await asyncio.sleep(0.05)
        if reader.at_eof() or time.monotonic() - t0 > 1.5:
            break
    _, data = await closed_after(reader)
    assert data == b"" and time.monotonic() - t0 < 2


async def test_a_kept_alive_connection_lives_until_its_idle_timeout_and_each_head_has_its_deadline(serve):
    gw = await serve(header_timeout_s=0.3, idle_timeout_s=1.2)
    reader, writer = await gw.connect()
    for _ in range(2):
        writer.write(HEALTH)
        assert await response(reader) == (200, {"status": "ok"})
        assert await still_open(reader, 0.5)  # past the head deadline: idle is not late
    writer.write(HEALTH[:10])  # a next request that stalls
    seconds, data = await closed_after(reader)
    assert data == b"" and 0.25 <= seconds < 0.9
    reader, writer = await gw.connect()
    writer.write(HEALTH)
    await response(reader)
    seconds, data = await closed_after(reader)
    assert data == b"" and 0.9 <= seconds < 3  # idle: aiohttp's keepalive_timeout


# --- the body ---------------------------------------------------------------------------------

async def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(serve):
    gw = await serve(header_timeout_s=5, body_timeout_s=0.3)
    reader, writer = await gw.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\":")
    status, body = await response(reader)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    _, rest = await closed_after(reader)
    assert rest == b""


# --- connections per client -------------------------------------------------------------------

async def test_connections_beyond_the_per_client_cap_get_429_then_close(serve):
    gw = await serve(header_timeout_s=10, max_connections_per_client=2)
    held = [await gw.connect() for _ in range(2)]
    reader, writer = await gw.connect()
    status, body = await response(reader)
    assert status == 429 and body["error"]["code"] == "too_many_connections"
    _, rest = await closed_after(reader)
    assert rest == b"" and gw.guard.refused == 1
    held[0][1].write(HEALTH)  # the ones within the cap are served
    assert await response(held[0][0]) == (200, {"status": "ok"})
    held[1][1].close()
    for _ in range(100):  # the server sees the close
        if gw.guard.open.get("127.0.0.1") == 1:
            break
        await asyncio.sleep(0.02)
    reader, writer = await gw.connect()
    writer.write(HEALTH)
    assert await response(reader) == (200, {"status": "ok"})


async def test_no_cap_lets_a_client_hold_many(serve):
    gw = await serve(max_connections_per_client=None)
    held = [await gw.connect() for _ in range(40)]
    held[-1][1].write(HEALTH)
    assert await response(held[-1][0]) == (200, {"status": "ok"})
    assert gw.guard.open["127.0.0.1"] == 40


# --- as `radixmesh serve gateway` runs it -------------------------------------------------------

def test_the_served_gateway_closes_silent_and_idle_connections():
    gw = GatewayProcess(1, "--header-timeout-s", "0.5", "--idle-timeout-s", "1", "--max-connections-per-client", "3")
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        assert silent.recv(1) == b"" and 0.4 <= time.monotonic() - t0 < 3
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        idle.sendall(HEALTH)
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert idle.recv(1) == b"" and 0.7 <= time.monotonic() - t0 < 4
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        assert held[-1].recv(4096).startswith(b"HTTP/1.1 429")
        for s in (silent, idle, *held):
            s.close()
    finally:
        gw.kill()
