"""The aiohttp application: routes, the middlewares, the readiness monitor.

Middlewares, outermost first: connections.track (the request head arrived), observe (span,
metrics), errors (everything leaves as OpenAI's envelope), access (API keys, rate limits,
the body deadline: auth.py, limits.py, connections.read_body)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from services.gateway.admin import admin_routes
from services.gateway.model_admin import model_admin_routes
from services.gateway.auth import KEYS, KeyRing
from services.gateway.backend import Backend, BackendError
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import embeddings_routes
from services.common import metrics
from services.gateway.connections import CONNECTIONS, ConnectionGuard, read_body, track
from services.gateway.errors import UNAVAILABLE, APIError, error_response, from_backend
from services.gateway.limits import LIMITER, TOKENS_USED, RateLimiter
from services.gateway.observe import METRICS, GatewayMetrics, middleware
from services.gateway.responses import responses_routes
from services.gateway.responses_store import RESPONSES, ResponseStore
from services.gateway.routes import routes
from services.gateway.sglang_compat import sglang_routes
from services.gateway.sse import OPENED
from services.gateway.state import STATE, GatewayState, monitor
from services.gateway.tokenize_routes import tokenize_routes

log = logging.getLogger(__name__)


def _http_error(e: web.HTTPException) -> APIError:
    if isinstance(e, web.HTTPNotFound):
        return APIError(404, "unknown route: see /openapi.json for the API", "not_found_error", code="unknown_route")
    if isinstance(e, web.HTTPMethodNotAllowed):
        return APIError(405, f"method not allowed; allowed: {', '.join(sorted(e.allowed_methods))}",
                        "invalid_request_error", code="method_not_allowed")
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return APIError(413, f"the request body is larger than {e.text}", "invalid_request_error",
                        code="request_too_large")
    return APIError(e.status, e.reason, "invalid_request_error" if e.status < 500 else "server_error")


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error envelope."""
    state: GatewayState = request.app[STATE]
    task = asyncio.current_task()
    state.inflight.add(task)
    try:
        return await handler(request)
    except APIError as e:
        response = error_response(e)
        if e.close:  # answer now, then close: aiohttp would linger reading the rest of the body
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
        return response
    except BackendError as e:
        return error_response(from_backend(e, state.config.retry_after_s))
    except web.HTTPRequestEntityTooLarge:
        return error_response(APIError(413, f"the request body is larger than --max-request-bytes "
                                       f"({state.config.max_request_bytes} bytes)", code="request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = error_response(_http_error(e))
        if isinstance(e, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ",".join(sorted(e.allowed_methods))
        return response
    except asyncio.CancelledError:
        if request.get(OPENED) or not state.cancelled_by_drain():
            raise  # the client went away, or a stream's end was cut off: nothing to answer
        return error_response(APIError(503, "the gateway is shutting down: the request was still running at its "
                                       "drain deadline (--drain-timeout-s)", UNAVAILABLE, code="shutting_down",
                                       retry_after=state.config.retry_after_s))
    except ConnectionResetError:
        raise  # the client went away: nothing to answer
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        return error_response(APIError(500, "internal error in the gateway", "server_error"))
    finally:
        state.inflight.discard(task)


@web.middleware
async def access(request: web.Request, handler) -> web.StreamResponse:
    """Who calls (401/403), within their rate limits (429), with the body in time (408); then
    the handler, and the tokens it used charged to the caller."""
    keys, limiter = request.app[KEYS], request.app[LIMITER]
    caller = keys.caller(request)
    if caller is None:  # an open probe
        return await handler(request)
    limiter.admit(caller, "this API key" if caller.startswith("key:") else "this client address")
    await read_body(request, request.app[STATE].config.body_timeout_s)
    try:
        return await handler(request)
    finally:
        limiter.charge(caller, request.get(TOKENS_USED, 0))


def build_app(config: GatewayConfig, backend: Backend, *, monitor_backend: bool = True) -> web.Application:
    """The gateway app. The backend is closed on cleanup; with monitor_backend the
    readiness check runs in the background (tests may drive state.refresh())."""
    app = web.Application(middlewares=[track, middleware, errors, access], client_max_size=config.max_request_bytes)
    app[STATE] = GatewayState(config, backend)
    app[METRICS] = GatewayMetrics()
    user_keys, admin_keys = config.keys()
    app[KEYS] = KeyRing(user_keys, admin_keys, config.probes_need_key)
    app[LIMITER] = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
    app[CONNECTIONS] = ConnectionGuard(config.header_timeout_s, config.max_connections_per_client)
    app[RESPONSES] = ResponseStore(config.responses_store_size, config.responses_store_ttl_s)
    app.add_routes(routes)
    app.add_routes(responses_routes)  # the Responses API (services/gateway/responses.py)
    app.add_routes(sglang_routes)  # SGLang's /get_model_info, /flush_cache (services/gateway/sglang_compat.py)
    app.add_routes(tokenize_routes)  # /tokenize, /detokenize, /v1/tokenize, /v1/detokenize
    app.add_routes(embeddings_routes)  # /v1/embeddings (services/gateway/embeddings.py)
    app.add_routes(admin_routes)  # /admin: the router's replicas (services/gateway/admin.py)
    app.add_routes(model_admin_routes)  # adapters and weight updates (services/gateway/model_admin.py)

    async def scrape(request: web.Request) -> web.Response:
        return await metrics.handle(app[METRICS].registry)

    app.router.add_get("/metrics", scrape)

    async def lifecycle(app: web.Application):
        task = asyncio.ensure_future(monitor(app[STATE])) if monitor_backend else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await backend.close()

    app.cleanup_ctx.append(lifecycle)
    return app
