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


async def closed_after(reader: asyncio.StreamReader, limit_s: float = 30.0) -> bytes:
    """What the server sent before it closed the connection; `limit_s` only bounds a hang."""
    return await asyncio.wait_for(reader.read(), limit_s)


async def server_side(gw: Gateway):
    """The guard's record of the gateway's one connection, once the server has it."""
    end = time.monotonic() + 30
    while len(gw.guard.guarded) != 1:
        assert time.monotonic() < end, f"the server never saw the connection: {gw.guard.guarded}"
        await asyncio.sleep(0.02)
    return next(iter(gw.guard.guarded.values()))


async def still_open(reader: asyncio.StreamReader, for_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), for_s) != b""
    except asyncio.TimeoutError:
        return True


async def response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode()
    lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), json.loads(body)


# --- the request head -------------------------------------------------------------------------

async def test_a_silent_connection_is_closed_after_the_header_timeout(serve):
    gw = await serve(header_timeout_s=0.3)
    reader, _ = await gw.connect()
    assert await closed_after(reader) == b""
    assert gw.guard.timed_out == 1  # closed by the head deadline, nothing else
    assert gw.guard.open == {}  # no longer counted against its client


async def test_half_a_header_is_cut_off_even_when_it_trickles(serve):
    gw = await serve(header_timeout_s=0.4)
    reader, writer = await gw.connect()
    conn = await server_side(gw)
    deadline = conn.timer.when() if conn.timer is not None else None  # the head's deadline, in the server loop's clock
    head = b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Pad: " + b"a" * 10_000  # never complete
    end = time.monotonic() + 60
    for byte in head:  # a byte every 50 ms: the deadline runs from the start, each byte leaves it
        if reader.at_eof() or conn.transport.is_closing():
            break
        assert time.monotonic() < end, "a trickling head kept the connection open"
        writer.write(bytes([byte]))
        await asyncio.sleep(0.05)
        assert conn.timer is None or conn.timer.when() == deadline
    else:
        raise AssertionError("a trickling head kept the connection open")
    assert await closed_after(reader) == b"" and gw.guard.timed_out == 1


@pytest.mark.slow  # waits out real idle timeouts
async def test_a_kept_alive_connection_lives_until_its_idle_timeout_and_each_head_has_its_deadline(serve):
    # between requests no head deadline runs (idle is not late); the next request's first byte starts one
    gw = await serve(header_timeout_s=0.3, idle_timeout_s=600)
    reader, writer = await gw.connect()
    conn = await server_side(gw)
    for _ in range(2):
        writer.write(HEALTH)
        assert await response(reader) == (200, {"status": "ok"})
        assert conn.timer is None  # answered: no head deadline armed while idle
        # past the head deadline (a timer armed before this wait fires before it ends): still open
        assert await still_open(reader, 0.5)
    writer.write(HEALTH[:10])  # a next request that stalls
    assert await closed_after(reader) == b"" and gw.guard.timed_out == 1  # its head deadline closed it
    # idle: aiohttp's keepalive_timeout closes it, not the head deadline, which is shorter and would fire first
    gw = await serve(header_timeout_s=1, idle_timeout_s=2.5)
    reader, writer = await gw.connect()
    writer.write(HEALTH)
    await response(reader)
    assert await closed_after(reader) == b"" and gw.guard.timed_out == 0


# --- the body ---------------------------------------------------------------------------------

async def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(serve):
    gw = await serve(header_timeout_s=5, body_timeout_s=0.3)
    reader, writer = await gw.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\":")
    status, body = await response(reader)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert await closed_after(reader) == b""


# --- connections per client -------------------------------------------------------------------

async def test_connections_beyond_the_per_client_cap_get_429_then_close(serve):
    gw = await serve(header_timeout_s=10, max_connections_per_client=2)
    held = [await gw.connect() for _ in range(2)]
    reader, writer = await gw.connect()
    status, body = await response(reader)
    assert status == 429 and body["error"]["code"] == "too_many_connections"
    assert await closed_after(reader) == b"" and gw.guard.refused == 1
    held[0][1].write(HEALTH)  # the ones within the cap are served
    assert await response(held[0][0]) == (200, {"status": "ok"})
    held[1][1].close()
    end = time.monotonic() + 30
    while gw.guard.open.get("127.0.0.1") != 1:  # the server sees the close
        assert time.monotonic() < end, f"the server never saw the close: {gw.guard.open}"
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

@pytest.mark.slow  # a served gateway process
def test_the_served_gateway_closes_silent_and_idle_connections():
    # socket timeouts (30 s) only bound a hang; what closed each connection, the gateway's log tells
    gw = GatewayProcess(1, "--header-timeout-s", "2", "--idle-timeout-s", "3", "--max-connections-per-client", "3")
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        silent = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert silent.recv(1) == b""
        assert gw.wait_log("connection closed").get("reason") == "no request head in time"
        idle = socket.create_connection(("127.0.0.1", port), timeout=30)
        idle.sendall(HEALTH)
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        assert idle.recv(1) == b""  # closed by the idle timeout (the head deadline, shorter, would log first)
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
        assert held[-1].recv(4096).startswith(b"HTTP/1.1 429")
        gw.wait_log("connection refused")  # logged after the idle close: the log up to here is all in gw.log
        assert [e.get("reason") for e in gw.log if e.get("msg") == "connection closed"] == ["no request head in time"]
        for s in (silent, idle, *held):
            s.close()
    finally:
        gw.kill()
