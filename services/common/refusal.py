"""A request a stage will not take, with the gRPC status its call fails with: raised by the
admission code of the scheduler and the tokenizer, turned into `context.abort(code, message)`
(or a RequestError on a stream of many requests) by their servicers."""
from __future__ import annotations

import grpc


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message
