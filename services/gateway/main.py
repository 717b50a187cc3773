"""`radixmesh serve gateway ...`: the OpenAI-compatible HTTP gateway.

    radixmesh serve gateway --http-port 8000 --tokenizer-addr 127.0.0.1:50051 [--listen 127.0.0.1:0]

Serves HTTP on --host:--http-port and, like every service, grpc.health.v1 (and
reflection) on --listen: SERVING exactly while /ready says 200. Logs JSON
lines; `listening` carries `port` (the gRPC one, as every service's does) and
`http_port`/`url` (useful with --http-port 0). On SIGTERM/SIGINT: health
NOT_SERVING, stop accepting HTTP connections, give in-flight requests
--drain-timeout-s to finish, cancel the rest (which aborts them in the mesh:
a stream ends with a `finish_reason: "abort"` chunk and `data: [DONE]`, any
other request gets 503), exit 0; a second signal cancels at once.

TLS (services/common/tls.py, the flags of every service): --tls-ca (+ --tls-client-cert/key)
for the channel to --tokenizer-addr (and /admin's), --tls-cert/--tls-key (+ --tls-client-ca)
for the gRPC health port; HTTP stays plain.

Without API keys the gateway answers anyone who can connect, which is fine on loopback (the
default --host); on any other address it logs a warning at start (`open to the network`).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import tls, tracing
from services.common.config import parse_config
from services.common.logging import setup_logging
from services.gateway.app import build_app
from services.gateway.auth import KEYS
from services.gateway.backend import Backend, GrpcBackend
from services.gateway.config import GatewayConfig
from services.gateway.connections import CONNECTIONS, GuardedSite
from services.gateway.state import STATE

log = logging.getLogger(__name__)
CONFIG_CLASS = GatewayConfig  # `radixmesh up` forwards the flags this accepts


def http_url(host: str, port: int) -> str:
    """A URL a client on this machine can use: a wildcard host becomes loopback."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or "" (every address)
        return False


def access_warnings(config: GatewayConfig, user_keys: bool, admin_keys: bool) -> list[str]:
    """What start-up should warn about who may call (logged, never a key)."""
    out = []
    if not user_keys and not is_loopback(config.host):
        out.append(f"the API is open to anyone who can reach {config.host}: no API key is set (--api-key-file, "
                   "$RADIXMESH_API_KEY)" + ("" if admin_keys else "; /admin too (--admin-api-key)"))
    return out


async def _health_server(listen: str, settings: tls.ServerTLS | None
                         ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """grpc health (and reflection) on `listen`, over TLS with `settings`; NOT_SERVING at first."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = tls.add_port(server, listen, settings)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {listen}: {e}") from e
    await server.start()
    return server, servicer, port


async def _drain(runner: web.AppRunner, state, health_servicer, timeout_s: float, forced: asyncio.Event) -> None:
    """Stop accepting, let in-flight requests finish until the deadline (or a
    second signal), then cancel them: cancelling a handler cancels its gRPC
    calls, which aborts the requests in the mesh; with `cut_off` set the handler
    still answers (routes._relay, app.errors)."""
    state.draining, state.ready = True, False
    await health_servicer.enter_graceful_shutdown()
    log.info("draining", extra={"in_flight": len(state.inflight), "timeout_s": timeout_s})
    for site in list(runner.sites):
        await site.stop()  # no new connections
    waiting = asyncio.ensure_future(forced.wait())
    deadline = asyncio.get_running_loop().time() + timeout_s
    while state.inflight and not forced.is_set():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        await asyncio.wait({*state.inflight, waiting}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if state.inflight:
        log.warning("cancelling requests still running", extra={
            "in_flight": len(state.inflight), "reason": "second signal" if forced.is_set() else "drain deadline"})
        state.cut_off = True
        for task in list(state.inflight):
            task.cancel()
        await asyncio.wait(set(state.inflight), timeout=5)
    await runner.cleanup()


async def serve(config: GatewayConfig, backend: Backend | None = None) -> int:
    """Run until SIGTERM/SIGINT (main thread only); returns the exit status."""
    tls.configure_clients(tls.client_tls(config.common))  # the backend's channel and /admin's, made below
    server_tls = tls.server_tls(config.common)
    app = build_app(config, backend or GrpcBackend(config.tokenizer_addr))
    state, keys = app[STATE], app[KEYS]
    for warning in access_warnings(config, keys.user_keys, keys.admin_keys):
        log.warning("open to the network", extra={"warning": warning})
    if keys.user_keys and not keys.admin_keys:
        log.info("admin routes are off", extra={"reason": "API keys are set but no --admin-api-key"})
    # The drain is ours (_drain); aiohttp's own shutdown only closes what is left. Its keep-alive
    # timeout is the idle one; the head deadline and the per-client cap are the site's.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None,
                           keepalive_timeout=config.idle_timeout_s)
    await runner.setup()
    try:
        await GuardedSite(runner, config.host, config.http_port, app[CONNECTIONS]).start()
        grpc_server, health_servicer, grpc_port = await _health_server(config.common.listen, server_tls)
    except OSError as e:
        log.error("cannot start", extra={"error": f"{e}"})
        await runner.cleanup()
        return 1

    async def set_health(ready: bool) -> None:
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if ready
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)

    state.watchers.append(set_health)
    await set_health(state.ready)  # the monitor may have run a check already
    http_port = runner.addresses[0][1]  # the bound one (--http-port 0 picks it)
    log.info("listening", extra={"address": f"{config.common.listen.rpartition(':')[0]}:{grpc_port}",
                                 "port": grpc_port, "http_port": http_port,
                                 "url": http_url(config.host, http_port), "tokenizer_addr": config.tokenizer_addr,
                                 "tls": server_tls.mode if server_tls else "off",
                                 "api_keys": keys.user_keys, "admin_keys": keys.admin_keys})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        stop.clear()  # a second signal cancels at once
        await _drain(runner, state, health_servicer, config.common.drain_timeout_s, stop)
        await grpc_server.stop(0)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("stopped", extra={"exit_status": 0})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    config = parse_config(GatewayConfig, argv, parser)
    setup_logging("gateway", config.common.log_level)
    try:
        tracing.setup("gateway")
    except ValueError as e:
        log.error("cannot start", extra={"error": str(e)})
        return 1
    import uvloop

    return uvloop.run(serve(config))


if __name__ == "__main__":
    import sys

    sys.exit(main())
