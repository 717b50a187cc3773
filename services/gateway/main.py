"""`radixmesh serve gateway ...`: the OpenAI-compatible HTTP gateway.

    radixmesh serve gateway --http-port 8000 --tokenizer-addr 127.0.0.1:50051

Logs JSON lines; `listening` carries the bound `port` (useful with
--http-port 0). On SIGTERM/SIGINT it stops accepting connections, gives
in-flight requests --drain-timeout-s to finish, cancels the rest (which aborts
them in the mesh) and exits 0; a second signal cancels at once.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from services.common.config import parse_config
from services.common.logging import setup_logging
from services.gateway.app import build_app
from services.gateway.backend import Backend, GrpcBackend
from services.gateway.config import GatewayConfig
from services.gateway.state import STATE

log = logging.getLogger(__name__)


async def serve(config: GatewayConfig, backend: Backend | None = None,
                started: asyncio.Future | None = None) -> int:
    """Run until SIGTERM/SIGINT (main thread only); returns the exit status.
    `started` (if given) receives the bound port."""
    app = build_app(config, backend or GrpcBackend(config.tokenizer_addr))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.drain_timeout_s,
                           access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.http_port).start()
    except OSError as e:
        log.error("cannot start", extra={"error": f"cannot listen on {config.host}:{config.http_port}: {e}"})
        await runner.cleanup()
        return 1
    port = runner.addresses[0][1]
    log.info("listening", extra={"address": f"http://{config.host}:{port}", "port": port,
                                 "tokenizer_addr": config.tokenizer_addr})
    if started is not None:
        started.set_result(port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        app[STATE].draining = True
        app[STATE].ready = False
        log.info("draining", extra={"timeout_s": config.drain_timeout_s})
        cleanup = asyncio.ensure_future(runner.cleanup())
        stop.clear()
        forced = asyncio.ensure_future(stop.wait())
        await asyncio.wait({cleanup, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not cleanup.done():
            log.warning("second signal: stopping now")
            cleanup.cancel()
        forced.cancel()
        await asyncio.gather(cleanup, forced, return_exceptions=True)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("stopped", extra={"exit_status": 0})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh serve gateway",
                                     description="OpenAI-compatible HTTP gateway of a radixmesh replica.")
    config = parse_config(GatewayConfig, argv, parser)
    setup_logging("gateway", config.log_level)
    import uvloop

    return uvloop.run(serve(config))


if __name__ == "__main__":
    import sys

    sys.exit(main())
