"""The one error of model administration (radixmesh.v1.ModelAdmin), at every stage.

Each stage raises AdminError with a code; its gRPC shell turns the code into a status
(`status_code`) and the next stage up turns the status back (`from_rpc_error`), so the
gateway's HTTP answer names what went wrong at the worker.
"""
from __future__ import annotations

import grpc

INVALID_ARGUMENT = "invalid_argument"  # bad path or input; an adapter or checkpoint that does not fit
NOT_FOUND = "not_found"  # an unknown adapter
FAILED_PRECONDITION = "failed_precondition"  # in use by live requests; another update under way
UNAVAILABLE = "unavailable"  # no worker, or it went away

_STATUS = {INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT, NOT_FOUND: grpc.StatusCode.NOT_FOUND,
           FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION, UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}
_CODE = {status: code for code, status in _STATUS.items()}


class AdminError(Exception):
    def __init__(self, code: str, message: str) -> None:
        if code not in _STATUS:
            raise ValueError(f"unknown admin error code {code!r}")
        super().__init__(message)
        self.code, self.message = code, message

    @property
    def status_code(self) -> grpc.StatusCode:
        return _STATUS[self.code]

    @classmethod
    def from_rpc_error(cls, exc: grpc.aio.AioRpcError, where: str) -> "AdminError":
        code = _CODE.get(exc.code(), UNAVAILABLE)
        detail = exc.details() or exc.code().name
        return cls(code, detail if code != UNAVAILABLE else f"{where}: {detail}")
