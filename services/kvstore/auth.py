"""Who may call the kvstore: a shared fleet token for pages, an admin token for Clear.

Clients send `authorization: Bearer <token>` metadata on every call (`bearer`).
With a fleet token configured, every KVStore method (Put, PutStream, Get,
GetStream, Exists, Stats) needs it or the admin token, else UNAUTHENTICATED.
Clear empties every replica's pages at once, so it needs the admin token: the
fleet token gets PERMISSION_DENIED, as does everyone when the store has a fleet
token but no admin token (Clear is off). Without either token the store answers
anyone, as before (loopback by default). Health and reflection stay open, so
probes work without a token.

Tokens are compared in constant time. A refusal is logged with the caller's
peer address; the client backs off after a failure (services/kvstore/client.py),
so a misconfigured client logs about once per retry interval, not per request.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any, Callable, Iterable

import grpc

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/radixmesh.v1.KVStore/"
ADMIN_METHODS = frozenset({SERVICE_PREFIX + "Clear"})
Refusal = tuple[grpc.StatusCode, str]


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `token` (none for None)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def presented_token(metadata: Iterable[Any] | None) -> str | None:
    """The bearer token in a call's metadata, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


def _same(presented: str | None, expected: str | None) -> bool:
    return presented is not None and expected is not None and \
        hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, fleet_token: str | None, admin_token: str | None) -> None:
        self.fleet_token, self.admin_token = fleet_token, admin_token

    def verdict(self, method: str, metadata: Iterable[Any] | None) -> Refusal | None:
        """None when the call may proceed, else the status and message to refuse it with."""
        if not method.startswith(SERVICE_PREFIX) or (self.fleet_token is None and self.admin_token is None):
            return None
        token = presented_token(metadata)
        admin = _same(token, self.admin_token)
        fleet = admin or _same(token, self.fleet_token)
        if method in ADMIN_METHODS:
            if admin:
                return None
            if fleet:
                why = "needs the admin token" if self.admin_token else "is off: the store has no admin token"
                return grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[1]} {why}"
            return grpc.StatusCode.UNAUTHENTICATED, "the admin token is required (authorization: Bearer ...)"
        if fleet or self.fleet_token is None:
            return None
        return grpc.StatusCode.UNAUTHENTICATED, "the fleet token is required (authorization: Bearer ...)"

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        refusal = self.verdict(details.method, details.invocation_metadata)
        if handler is None or refusal is None:
            return handler
        return _refusing(handler, details.method, *refusal)


def _refusing(handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode,
              message: str) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by one that aborts with (code, message).
    grpc.aio dispatches on the function kind, so a streaming response gets an async generator."""
    kind = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary")

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        log.warning("kvstore call refused", extra={"method": method, "code": code.name, "peer": context.peer()})
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request, context)
        yield  # unreachable: abort raises

    return handler._replace(**{kind: refuse_stream if handler.response_streaming else refuse})
