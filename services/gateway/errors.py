"""OpenAI's error envelope, and how every failure maps onto an HTTP status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Handlers raise APIError (or let BackendError / InvalidRequest escape); the
middleware in app.py renders them with `error_response`. Status mapping:
  400 invalid input (InvalidRequest, gRPC INVALID_ARGUMENT / OUT_OF_RANGE / FAILED_PRECONDITION)
  401 no valid API key, 403 a user key on an admin route (auth.py)
  404 unknown route, 405 wrong method, 408 body not received in time, 413 body over --max-request-bytes
  429 + Retry-After: a rate limit (limits.py)
  503 + Retry-After: queue full (RESOURCE_EXHAUSTED) or backend unavailable
  504 backend deadline exceeded; 500 only for a failure of the mesh itself.
"""
from __future__ import annotations

import json

from aiohttp import web

from services.gateway.backend import BackendError

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "overloaded_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error a client sees: HTTP status plus OpenAI's error object fields."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = headers or {}
        self.close = close  # close the connection after the answer (e.g. a body that did not arrive)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


# gRPC status code name → (HTTP status, error type, retryable)
_GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": (400, INVALID_REQUEST, False),
    "OUT_OF_RANGE": (400, INVALID_REQUEST, False),
    "FAILED_PRECONDITION": (400, INVALID_REQUEST, False),
    "NOT_FOUND": (404, NOT_FOUND, False),
    "ALREADY_EXISTS": (409, INVALID_REQUEST, False),
    "RESOURCE_EXHAUSTED": (503, OVERLOADED, True),
    "UNAVAILABLE": (503, UNAVAILABLE, True),
    "DEADLINE_EXCEEDED": (504, SERVER_ERROR, True),
}


def from_backend(err: BackendError, retry_after: int) -> APIError:
    """Map a backend failure; unknown codes are the mesh's own fault (500)."""
    status, type_, retryable = _GRPC_TO_HTTP.get(err.code, (500, SERVER_ERROR, False))
    code = err.code.lower()
    message = err.message or f"backend error: {err.code}"
    return APIError(status, message, type_, code=code, retry_after=retry_after if retryable else None)


def error_response(err: APIError) -> web.Response:
    headers = {**err.headers, **({"Retry-After": str(err.retry_after)} if err.retry_after is not None else {})}
    response = web.Response(status=err.status, text=json.dumps(err.body()),
                            content_type="application/json", headers=headers)
    if err.close:
        response.force_close()
    return response
