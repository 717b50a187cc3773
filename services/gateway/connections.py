"""Connection limits aiohttp's server does not have: a deadline for the request head, a
deadline for the body, and a cap on the connections one client address holds open.

    guard = ConnectionGuard(header_timeout_s=10, max_per_client=256)
    runner = web.AppRunner(app, keepalive_timeout=idle_timeout_s)   # aiohttp's own idle timeout
    await GuardedSite(runner, host, port, guard).start()

`GuardedSite` serves the runner's protocol behind a `_Guarded` protocol per connection:
  cap      a client address already holding `max_per_client` connections gets a one-off
           429 (OpenAI's envelope, code too_many_connections), then the connection closes;
           the app never sees it
  head     a connection is closed when no whole request head has arrived `header_timeout_s`
           after it opened, or after the first byte of its next request: silent and
           half-sent requests (slowloris) cannot hold a socket. `track`, the outermost
           middleware, tells the guard when a head has arrived (the app has the request)
           and when its answer is done.
  idle     between requests, aiohttp's keepalive_timeout closes the connection.
  body     `read_body` reads a request's body within body_timeout_s, else 408 and close.
Under aiohttp's TestServer (no GuardedSite) `track` finds no guarded connection and does nothing.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import cast

from aiohttp import web

from services.gateway.errors import APIError

log = logging.getLogger(__name__)

REFUSAL_LINGER_S = 2.0  # a refused client may still be sending its request: read it, then close


def _too_many(cap: int) -> bytes:
    body = json.dumps({"error": {"message": f"too many open connections from this address (at most {cap}); "
                                           "close some or reuse them", "type": "requests", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    def __init__(self, header_timeout_s: float, max_per_client: int | None) -> None:
        self.header_timeout_s, self.max_per_client = header_timeout_s, max_per_client
        self.open: dict[str, int] = {}  # client address -> connections it holds
        self.guarded: dict[asyncio.BaseTransport, _Guarded] = {}
        self.refused = self.timed_out = 0  # connections, since start

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for loop.create_server that guards each of `inner`'s protocols."""
        return lambda: _Guarded(self, inner())

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self.guarded.get(transport) if transport is not None else None
        if conn is not None:
            conn.busy = True
            conn.disarm()

    def request_ended(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self.guarded.get(transport) if transport is not None else None
        if conn is not None:
            conn.busy = False  # the next request's first byte arms the head deadline again


class _Guarded(asyncio.Protocol):
    """One connection: counts it for its client, forwards everything to aiohttp's protocol."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.client: str | None = None  # set once counted (not for a refused connection)
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.transport = transport
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
        cap = self.guard.max_per_client
        if cap is not None and self.guard.open.get(client, 0) >= cap:
            self.guard.refused += 1
            log.warning("connection refused", extra={"client": client, "open": cap, "reason": "too many connections"})
            transport.write(_too_many(cap))
            if transport.can_write_eof():
                transport.write_eof()  # the answer, then EOF; reading on avoids a reset that could lose it
                asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)
            else:
                transport.close()
            return
        self.client = client
        self.guard.open[client] = self.guard.open.get(client, 0) + 1
        self.guard.guarded[transport] = self
        self.arm()
        self.inner.connection_made(transport)

    def arm(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._head_late)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_late(self) -> None:
        self.timer = None
        if not self.busy and self.transport is not None:
            self.guard.timed_out += 1
            log.info("connection closed", extra={"client": self.client, "reason": "no request head in time",
                                                 "timeout_s": self.guard.header_timeout_s})
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.client is None:
            return  # refused: drained and dropped
        if not self.busy:
            self.arm()  # the first byte of a request: its head has header_timeout_s from now
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.client is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.client is None:
            return
        self.guard.guarded.pop(self.transport, None)  # type: ignore[arg-type]
        left = self.guard.open.get(self.client, 1) - 1
        if left > 0:
            self.guard.open[self.client] = left
        else:
            self.guard.open.pop(self.client, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.client is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.client is not None:
            self.inner.resume_writing()


class GuardedSite(web.TCPSite):
    """aiohttp's TCPSite, its connections behind `guard`."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(server), self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


CONNECTIONS = web.AppKey("radixmesh_gateway_connections", ConnectionGuard)


@web.middleware
async def track(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: the request head has arrived; the connection is busy until the answer is done."""
    guard = request.app[CONNECTIONS]
    transport = request.transport
    guard.request_started(transport)
    try:
        return await handler(request)
    finally:
        guard.request_ended(transport)


async def read_body(request: web.Request, timeout_s: float) -> None:
    """Read the body (aiohttp keeps it for the handler's own read), or APIError 408 with the
    connection closed. A body over client_max_size raises HTTPRequestEntityTooLarge, as before."""
    if not request.can_read_body:
        return
    try:
        await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        log.info("body too slow", extra={"path": request.path, "client": request.remote, "timeout_s": timeout_s})
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                       close=True) from None
