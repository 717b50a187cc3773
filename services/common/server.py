"""The gRPC bootstrap every service runs: health, reflection, graceful drain.

Lifecycle of `serve`:
  1. bind `config.listen`, start the server; health is NOT_SERVING
  2. await on_start() (load the model, connect downstream); meanwhile
     application RPCs are refused with UNAVAILABLE; then health → SERVING
  3. on SIGTERM/SIGINT: health → NOT_SERVING (watchers are told), new
     application RPCs are refused with UNAVAILABLE (retryable: a router sends
     them elsewhere) while health and reflection keep answering, so probes see
     "draining" rather than a refused connection
  4. await on_drain(deadline) (e.g. stop admitting, finish or abort requests),
     then wait for in-flight RPCs, both bounded by deadline = signal time +
     config.drain_timeout_s; server.stop(grace=what is left) cancels stragglers
  5. return 0 (1 when on_start failed). A second signal skips the waiting.

While serving, a service that passes a `Readiness` keeps its health in step
with it: NOT_SERVING while it says not ready (e.g. the scheduler lost or
stalled on its worker), SERVING again when it recovers. Application RPCs
are not refused for it: the service decides what not being ready means.

TLS (services/common/tls.py): with `config.tls_cert` the port is bound with TLS
(and client certificates required with `config.tls_client_ca`); `run_service`
installs the config's client settings for every channel the process opens.

Observability: `run_service` sets up tracing from the OTEL_* environment
(services/common/tracing.py), whose server interceptor then spans every
application RPC; with `config.metrics_port` set (0 = a free port) the
service's Prometheus registry is served at /metrics on the listen host, and
the `listening` line carries `metrics_port`.

Service names for reflection and per-service health are discovered from what
`add_servicers` registers (generated `add_*Servicer_to_server` helpers and
generic handlers with a `service_name()`), so the caller lists them nowhere.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import metrics as metrics_http
from services.common import tls, tracing

log = logging.getLogger(__name__)

# RPCs that keep working while draining and never count as in flight (a
# health Watch stream lives as long as its client).
_CONTROL_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")


class ServiceOptions(Protocol):
    """What serve() reads from a config: CommonConfig has exactly these."""

    listen: str
    drain_timeout_s: float


class _Gate(grpc.aio.ServerInterceptor):
    """Refuses application RPCs unless serving; counts the ones in flight.

    `refusal` is None while serving, else the UNAVAILABLE message: servicers
    never see a call before on_start finished or after draining began.
    Behaviours must be async (coroutine functions or async generator
    functions, as everywhere in radixmesh); sync ones pass through untracked.
    """

    def __init__(self) -> None:
        self.refusal: str | None = "server is starting"
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_CONTROL_PREFIXES):
            return handler
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        # grpc.aio dispatches on the behaviour's function kind (coroutine vs
        # async generator), so the wrapper must be of the same kind.
        wrapped = self._wrap_stream(behavior) if inspect.isasyncgenfunction(behavior) \
            else self._wrap_call(behavior)
        return handler._replace(**{kind: wrapped})

    def _wrap_call(self, behavior: Callable) -> Callable:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
            self._enter()
            try:
                return await behavior(request, context)
            finally:
                self._exit()
        return call

    def _wrap_stream(self, behavior: Callable) -> Callable:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
            self._enter()
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self._exit()
        return stream


class _Registrar:
    """Stands in for the server inside add_servicers, noting service names."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.service_names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        handlers = tuple(handlers)
        for h in handlers:
            name = getattr(h, "service_name", None)
            if callable(name) and name() not in self.service_names:
                self.service_names.append(name())
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        if service_name not in self.service_names:
            self.service_names.append(service_name)
        self._server.add_registered_method_handlers(service_name, handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


MAX_MESSAGE_BYTES = 64 << 20


class Readiness:
    """A service's own verdict on whether it can serve; serve() mirrors it into gRPC health."""

    def __init__(self) -> None:
        self.ready = True
        self.reason: str | None = None
        self._changed = asyncio.Event()

    def set(self, ready: bool, reason: str | None = None) -> None:
        if ready and not self.ready:
            log.info("ready again", extra={"was": self.reason})
        elif not ready and self.ready:
            log.warning("not ready", extra={"reason": reason})
        self.ready, self.reason = ready, None if ready else reason
        self._changed.set()

    async def mirror(self, set_status: Callable[[int], Awaitable[None]]) -> None:
        """Forever: set the health status from `ready`, then wait for the next change."""
        while True:
            self._changed.clear()
            await set_status(health_pb2.HealthCheckResponse.SERVING if self.ready
                             else health_pb2.HealthCheckResponse.NOT_SERVING)
            await self._changed.wait()


async def serve(
    service_name: str,
    config: ServiceOptions,
    add_servicers: Callable[[grpc.aio.Server], None],
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_drain: Callable[[float], Awaitable[None]] | None = None,
    *,
    server_options: list[tuple[str, Any]] | None = None,
    registry: Any = None,
    readiness: Readiness | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    on_bound: Callable[[str], None] | None = None,
) -> int:
    """Run a service until SIGTERM/SIGINT; returns the process exit status.

    on_drain receives the deadline as a `time.monotonic()` value. `interceptors` (e.g.
    the kvstore's token check) run after the drain gate and before tracing, so a call
    they refuse makes no span. `registry` (a
    prometheus_client CollectorRegistry) is served when config.metrics_port is set. Raises
    OSError when `config.listen` cannot be bound. Must run on the main thread
    (signal handlers); `run_service` wraps it with uvloop.
    """
    loop = asyncio.get_running_loop()
    gate = _Gate()
    # Step plans and long prompts can exceed gRPC's 4 MB default message size.
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *(server_options or [])]
    # The gate first: a refused call makes no span.
    server = grpc.aio.server(interceptors=[gate, *interceptors, *tracing.server_interceptors()], options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    registrar = _Registrar(server)
    add_servicers(registrar)  # type: ignore[arg-type]  # duck-types grpc.aio.Server
    names = registrar.service_names
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    async def set_all(status: int) -> None:
        for name in ("", *names):  # "" is the whole server's status
            await health_servicer.set(name, status)

    # Signal handlers first: a SIGTERM that arrives as soon as `listening` is
    # logged must drain, not kill the process with the default action.
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    status = 0
    metrics_runner = None
    try:
        await set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        server_tls = tls.server_tls(config)
        try:
            port = tls.add_port(server, config.listen, server_tls)
        except RuntimeError as e:  # grpcio raises where older versions returned 0
            raise OSError(f"{service_name}: cannot listen on {config.listen}: {e}") from e
        if port == 0:
            raise OSError(f"{service_name}: cannot listen on {config.listen}")
        await server.start()
        host = config.listen.rpartition(":")[0]
        extra: dict[str, Any] = {"address": f"{host}:{port}", "port": port, "services": names,
                                 "tls": server_tls.mode if server_tls else "off"}
        metrics_port = getattr(config, "metrics_port", None)
        if metrics_port is not None:
            from prometheus_client import CollectorRegistry

            metrics_runner, extra["metrics_port"] = await metrics_http.serve(
                registry or CollectorRegistry(), host.strip("[]"), metrics_port)
        log.info("listening", extra=extra)
        if on_bound is not None:  # the address it serves on (a port 0 resolved), before on_start
            on_bound(extra["address"])

        starting = asyncio.ensure_future(on_start() if on_start else asyncio.sleep(0))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and starting.exception() is not None:
            log.error("start failed", exc_info=starting.exception())
            status = 1
        elif starting.done():
            gate.refusal = None
            await set_all(health_pb2.HealthCheckResponse.SERVING)
            log.info("serving")
            mirror = asyncio.ensure_future((readiness or Readiness()).mirror(set_all))
            await asyncio.wait({stopping, mirror}, return_when=asyncio.FIRST_COMPLETED)
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)
        else:
            starting.cancel()  # a signal while loading: no point finishing the load
            await asyncio.gather(starting, return_exceptions=True)
        stopping.cancel()
        await _drain(server, gate, health_servicer, config.drain_timeout_s, on_drain, signals)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
    log.info("stopped", extra={"exit_status": status})
    return status


async def _drain(server: grpc.aio.Server, gate: _Gate, health_servicer: Any,
                 timeout_s: float, on_drain: Callable[[float], Awaitable[None]] | None,
                 signals: tuple[signal.Signals, ...]) -> None:
    """Steps 3-4 of the lifecycle; a second signal cancels the waiting."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    await health_servicer.enter_graceful_shutdown()  # NOT_SERVING, and it stays so
    gate.refusal = "server is draining"
    log.info("draining", extra={"in_flight": gate.in_flight, "timeout_s": timeout_s})

    async def wind_down() -> None:
        if on_drain is not None:
            await on_drain(deadline)
        await gate.wait_idle()

    waiting = asyncio.ensure_future(wind_down())
    forced = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, forced.set)
    forcing = asyncio.ensure_future(forced.wait())
    try:
        await asyncio.wait({waiting, forcing}, timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:  # also runs when serve itself is cancelled
        forcing.cancel()
        if not waiting.done():
            waiting.cancel()
    if not waiting.done():
        reason = "second signal: stopping now" if forced.is_set() else "drain deadline passed"
        log.warning(reason, extra={"in_flight": gate.in_flight})
    elif not waiting.cancelled() and waiting.exception() is not None:
        log.error("on_drain failed", exc_info=waiting.exception())
    # Whatever is still running is cancelled at the deadline, or now if forced.
    await server.stop(grace=0.0 if forced.is_set() else max(0.0, deadline - time.monotonic()))


def run_service(service_name: str, config: Any, add_servicers: Callable[[grpc.aio.Server], None],
                on_start: Callable[[], Awaitable[None]] | None = None,
                on_drain: Callable[[float], Awaitable[None]] | None = None, *, registry: Any = None,
                readiness: Readiness | None = None,
                interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                on_bound: Callable[[str], None] | None = None) -> int:
    """Synchronous entry point: JSON logging from `config.log_level`, tracing from the
    environment, then `serve` on a uvloop event loop. Returns the exit status for sys.exit."""
    import uvloop

    from services.common.logging import setup_logging

    setup_logging(service_name, getattr(config, "log_level", "info"))
    tls.configure_clients(tls.client_tls(config))  # before on_start dials anything
    try:
        tracing.setup(service_name)
    except ValueError as e:  # e.g. an unknown OTEL_TRACES_EXPORTER
        logging.getLogger(__name__).error("cannot start", extra={"error": str(e)})
        return 1
    try:
        return uvloop.run(serve(service_name, config, add_servicers, on_start, on_drain, registry=registry,
                                readiness=readiness, interceptors=interceptors, on_bound=on_bound))
    except OSError as e:  # e.g. the port is taken: say so in one line, not a traceback
        logging.getLogger(__name__).error("cannot start", extra={"error": str(e)})
        return 1
