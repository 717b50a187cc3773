"""One attempt of a Generate on one replica, relayed event by event, and the retry rules.

An attempt that fails before its first event with a code that says the replica could not take
the request — UNAVAILABLE (draining, down, worker gone) or RESOURCE_EXHAUSTED (queue full), as
the call's status or as its first event — raises `Retry`; any other code raises `Passthrough`
(the client's answer: INVALID_ARGUMENT, which another replica would give too; INTERNAL and
UNKNOWN, which the request itself may cause). Once an event was relayed nothing is retried: a
replica that goes away mid-stream ends the stream with one Error event naming it (with its
code). The attempt's outcome feeds the replica's breaker, and its fleet's readiness.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from services.router import metrics
from services.router.fleet import Fleet, Replica

log = logging.getLogger(__name__)

# Codes that say "this replica could not take it", not "the request is wrong": retried elsewhere
# when nothing was relayed yet.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Codes that count against the replica's breaker (a fault of the replica, or possibly one).
REPLICA_FAULTS = RETRYABLE | {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED,
                              grpc.StatusCode.DEADLINE_EXCEEDED}
BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class Retry(Exception):
    """The attempt failed before its first event with a RETRYABLE code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class Passthrough(Exception):
    """The attempt failed with a code that is the client's answer (no retry)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


@dataclass(frozen=True)
class Version:
    """How the router relays one version of the tokenizer's Generate."""
    call: Callable  # replica -> its Generate method
    response: type  # the stream's message class
    has_error: Callable  # message -> whether it is the request's error

    def error_code(self, event) -> grpc.StatusCode | None:
        """The code of an Error event (None for any other event)."""
        return BY_VALUE.get(event.error.code) if self.has_error(event) else None


V1 = Version(lambda r: r.stub.Generate, cpb.GenerateResponse, lambda ev: ev.WhichOneof("event") == "error")
V2 = Version(lambda r: r.stub_v2.Generate, pb2.GenerateResponse, lambda ev: ev.HasField("error"))


def backoff(config, rng: random.Random, retry: int) -> float:
    """Seconds before retry number `retry` (1, 2, ...): doubling, capped, ±50 % jitter."""
    base = min(config.retry_backoff_max_s, config.retry_backoff_s * 2 ** (retry - 1))
    return base * rng.uniform(0.5, 1.5)


async def relay(replica: Replica, fleet: Fleet, request: pb.GenerateTextRequest,
                version: Version) -> AsyncIterator:
    """Relay one attempt (the replica was chosen: `fleet.choose` began it; this ends it). Before
    its first event, a failure raises Retry (RETRYABLE codes) or Passthrough (any other); after
    it, the stream ends with an Error event. Closing the generator cancels the call."""
    call = version.call(replica)(request)
    started, outcome, code = False, None, ""
    try:
        async for event in call:
            error = version.error_code(event)
            if error in REPLICA_FAULTS:
                outcome, code = False, error.name
            if not started and error in RETRYABLE:
                raise Retry(error, event.error.message)
            started = True
            yield event
        if code == "":
            outcome = True
    except grpc.aio.AioRpcError as e:
        outcome, code = (False, e.code().name) if e.code() in REPLICA_FAULTS else (None, "")
        if not started:
            raise (Retry if e.code() in RETRYABLE else Passthrough)(e.code(), e.details() or "") from None
        if e.code() == grpc.StatusCode.CANCELLED:
            raise  # the client went away: nothing to tell it
        metrics.MID_STREAM.labels(fleet.model_name, replica.address).inc()
        log.warning("replica failed mid-stream", extra={"rid": request.rid, "replica": replica.address,
                                                         "code": e.code().name})
        yield version.response(error=cpb.Error(
            code=e.code().value[0],
            message=f"replica {replica.address} failed mid-stream: {e.code().name} {e.details() or ''}".rstrip()))
    finally:
        call.cancel()  # no-op once ended; else aborts the request in the replica
        replica.end(outcome, code)
        fleet.update_readiness()  # a failure may have opened the last closed breaker
