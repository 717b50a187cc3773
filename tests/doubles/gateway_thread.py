"""Run a gateway on a loopback port in a background thread (tests, demos).

    with GatewayThread(FakeBackend()) as gw:
        openai.OpenAI(base_url=gw.url + "/v1", api_key="x").models.list()

The gateway gets its own event loop in the thread; `gw.run(coro)` runs a
coroutine there (e.g. to inspect the backend between requests). `gw.drain(timeout_s)`
stops it as SIGTERM stops `radixmesh serve gateway` (services/gateway/main.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import replace
from typing import Any, Coroutine

from aiohttp import web
from grpc_health.v1 import health

from services.gateway.app import build_app
from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.main import _drain
from services.gateway.state import STATE, GatewayState


class GatewayThread:
    def __init__(self, backend: Backend, config: GatewayConfig | None = None) -> None:
        self.backend = backend
        self.config = replace(config or GatewayConfig(), host="127.0.0.1", http_port=0)
        self.loop = asyncio.new_event_loop()  # gRPC aio clients in a side thread: asyncio's loop
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)

    @property
    def state(self) -> GatewayState:
        return self._runner.app[STATE]

    def start(self) -> "GatewayThread":
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(build_app(self.config, self.backend), handler_cancellation=True,
                                     shutdown_timeout=self.config.common.drain_timeout_s, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        await self.state.refresh()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def drain(self, timeout_s: float) -> None:
        """SIGTERM's drain: stop accepting, wait up to `timeout_s` for in-flight requests, cut off the
        rest, clean up. The gateway is stopped after it (stop() then only ends the thread)."""
        runner, self._runner = self._runner, None
        state = runner.app[STATE]

        async def drain() -> None:
            await _drain(runner, state, health.aio.HealthServicer(), timeout_s, asyncio.Event())
        self.run(drain(), timeout=timeout_s + 30)

    def stop(self) -> None:
        if self._runner is not None:
            try:
                self.run(self._runner.cleanup())
            except concurrent.futures.TimeoutError:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "GatewayThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
