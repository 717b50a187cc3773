"""What the gateway knows about its backend: the served model, and whether it can serve.

`monitor` refreshes it every --ready-interval-s: ready means the backend's
grpc health says SERVING *and* Info answers. A request arriving before the
first successful check triggers one check itself instead of failing at once.
Between polls, a backend with `health_changes()` (GrpcBackend: a grpc health
Watch) triggers a check whenever its health changes, so /ready follows e.g. a
router whose last routable replica was drained at once, not a poll later.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from aiohttp import web

from services.gateway.backend import Backend, BackendError, ModelInfo
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    config: GatewayConfig
    backend: Backend
    info: ModelInfo | None = None
    ready: bool = False
    draining: bool = False
    cut_off: bool = False  # the drain deadline passed: the handlers still running are being cancelled
    not_ready_reason: str = "the backend has not been checked yet"
    started: int = field(default_factory=lambda: int(time.time()))
    inflight: set[asyncio.Task] = field(default_factory=set)  # request handlers running now (drain)
    # Called with the new value whenever `ready` changes (e.g. the gRPC health status).
    watchers: list[Callable[[bool], Awaitable[None]]] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names requests may send, the id first: --served-model-name, else the backend's."""
        return self.config.served_names or ((self.info.name,) if self.info else ())

    @property
    def served_name(self) -> str:
        """The id /v1/models reports and responses carry ("" while the backend is unknown)."""
        return next(iter(self.served_names), "")

    async def refresh(self) -> bool:
        """One readiness check; updates ready/info and logs transitions."""
        async with self._lock:
            was = self.ready
            reason = await self.backend.not_ready() or ""
            if not reason:
                try:
                    info = await self.backend.info()
                    self.info = replace(info, tool_call_format=self.config.tool_format(info.tool_call_format))
                except BackendError as e:
                    reason = f"the backend's Info failed: {e.message or e.code}"
            if self.draining:
                reason = "the gateway is shutting down"
            self.ready, self.not_ready_reason = not reason, reason
            if self.ready != was:
                log.info("ready" if self.ready else "not ready", extra={"reason": reason or None,
                                                                        "model": self.served_name})
                await self.notify()
            return self.ready

    def cancelled_by_drain(self) -> bool:
        """In a handler that caught CancelledError: True when the drain deadline sent it (the handler
        then answers: an abort chunk, a 503), with the cancellation taken back so that asyncio
        (3.11+: timeouts, task groups) does not count the task as still cancelled; False = the
        client went away."""
        if not self.cut_off:
            return False
        task = asyncio.current_task()
        if hasattr(task, "uncancel"):  # Python 3.11+
            task.uncancel()
        return True

    async def notify(self) -> None:
        for watch in self.watchers:
            await watch(self.ready)

    async def require_info(self) -> ModelInfo:
        """The model's info, or a 503 APIError while the backend is not known."""
        if self.info is None:
            await self.refresh()
        if self.info is None:
            raise APIError(503, f"the model is not available yet: {self.not_ready_reason}",
                           "service_unavailable_error", code="not_ready", retry_after=self.config.retry_after_s)
        return self.info


STATE = web.AppKey("radixmesh_gateway_state", GatewayState)


async def monitor(state: GatewayState) -> None:
    follow = asyncio.ensure_future(follow_health(state))
    try:
        while True:
            try:
                await state.refresh()
            except Exception:  # a probe must never end the monitor
                log.exception("readiness check failed")
            await asyncio.sleep(state.config.ready_interval_s)
    finally:
        follow.cancel()


async def follow_health(state: GatewayState, retry_s: float = 1.0) -> None:
    """Refresh on every health change the backend reports; re-watch after a broken stream."""
    changes = getattr(state.backend, "health_changes", None)
    if changes is None:
        return
    while True:
        try:
            async for _ in changes():
                await state.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the backend went away or does not serve Watch: polling still runs
            log.debug("health watch ended", extra={"error": repr(e)})
        await asyncio.sleep(min(retry_s, state.config.ready_interval_s))
