"""Generate on a disaggregated fleet: each request runs on a pair, a prefill replica P and a
decode replica D (docs/router.md, "Routing a disaggregated fleet").

Per attempt: P is chosen by the prefill pool's policy (cache_aware by default: the prompt's
prefix cache is P's), D by the decode pool's; a new `room` (uuid hex) names the pair. The same
request goes to both at once, to P with `Disaggregation{PREFILL, room}`, to D with
`Disaggregation{DECODE, room, bootstrap_address}` (P's, from its Info at admission). P prefills,
samples the first token and sends the KV to D; D's stream, which starts with that token, is the
one relayed to the client (services/router/relay.py). P's stream (one token) is drained in a
task and discarded; it is cancelled when D's relay ends.

Failures: if either side fails before D relayed an event, the pair fails. A RETRYABLE code
(UNAVAILABLE, RESOURCE_EXHAUSTED) retries the whole pair, avoiding the replica that failed (when
P failed first, D's failure is taken for a consequence and P is the one avoided), within
--max-retries and the breakers, after the usual backoff; a retried pair runs under `rid.N` so
that a side still aborting the previous attempt's request cannot clash with it. Any other code is
the client's answer. Once D relayed an event, P's fate no longer matters. Cancelling the
client's call cancels both sides. n > 1 is refused (INVALID_ARGUMENT): one room carries one
sequence.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from services.router import metrics
from services.router.fleet import Replica
from services.router.keys import routing_key
from services.router.pools import Pools
from services.router.relay import REPLICA_FAULTS, RETRYABLE, Passthrough, Retry, Version, backoff, relay
from services.router.roles import DECODE, PREFILL

log = logging.getLogger(__name__)

Failure = tuple[grpc.StatusCode, str]  # a side's code and message


class PairRetry(Exception):
    """The pair failed before D streamed, with a RETRYABLE code; `replica` (of `role`) is avoided next."""

    def __init__(self, role: str, replica: Replica, code: grpc.StatusCode, message: str) -> None:
        self.role, self.replica, self.code, self.message = role, replica, code, message


class Pairing:
    def __init__(self, config, pools: Pools, rng: random.Random) -> None:
        self.config, self.pools, self._rng = config, pools, rng

    async def generate(self, request: pb.GenerateTextRequest, context: grpc.aio.ServicerContext,
                       version: Version) -> AsyncIterator:
        """Relay D's stream of a pair; retry another pair while nothing was streamed."""
        if request.HasField("n") and request.n > 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n > 1 is not served by disaggregated replicas")
        if not request.rid:
            request.rid = uuid.uuid4().hex
        key = routing_key(request)
        avoid: dict[str, set[str]] = {PREFILL: set(), DECODE: set()}
        last = (grpc.StatusCode.UNAVAILABLE, "no prefill/decode pair is available")
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff(self.config, self._rng, attempt))
            pair = self._choose(key, avoid, request.adapter)
            if isinstance(pair, str):
                last = (grpc.StatusCode.UNAVAILABLE, pair)
                break
            try:
                async for event in self._attempt(*pair, request, version, attempt):
                    yield event
                return
            except Passthrough as e:
                await context.abort(e.code, e.message)
            except grpc.aio.AioRpcError as e:  # D cancelled the call mid-stream
                await context.abort(e.code(), e.details() or "")
            except PairRetry as e:
                avoid[e.role].add(e.replica.address)
                last = (e.code, f"{e.message} ({e.role} replica {e.replica.address})")
                if attempt < self.config.max_retries:
                    metrics.RETRIES.labels(self.pools.model_name, e.replica.address).inc()
                log.info("pair failed before streaming", extra={
                    "rid": request.rid, "role": e.role, "replica": e.replica.address, "code": e.code.name,
                    "attempt": attempt + 1})
        await context.abort(*last)

    def _choose(self, key: str, avoid: dict[str, set[str]], adapter: str) -> tuple[Replica, Replica] | str:
        """A pair (both begun), or why there is none. D's pool is checked first so that P is never
        begun for a pair that cannot be made."""
        prefill, decode = self.pools.prefill, self.pools.decode
        for role, fleet in ((DECODE, decode), (PREFILL, prefill)):
            if not any(r.routable for r in fleet.replicas.values()):
                return f"no {role} replica is available"
        p, _ = prefill.choose(key, avoid[PREFILL], adapter)
        d, _ = decode.choose(key, avoid[DECODE], adapter)
        metrics.PAIRS.labels(self.pools.model_name, p.address, d.address).inc()
        return p, d

    async def _attempt(self, p: Replica, d: Replica, request: pb.GenerateTextRequest, version: Version,
                       attempt: int) -> AsyncIterator:
        room = uuid.uuid4().hex
        rid = request.rid if attempt == 0 else f"{request.rid}.{attempt}"
        bootstrap = p.info.bootstrap_address if p.info is not None else ""
        prefill = asyncio.create_task(self._drain(p, side_request(request, rid, PREFILL, room), version))
        decode = relay(d, self.pools.decode, side_request(request, rid, DECODE, room, bootstrap), version)
        # Created after `prefill`, so it runs (and begins D's call) before P can have failed.
        first = asyncio.ensure_future(decode.__anext__())
        try:
            event = await self._first(first, prefill, p, d)
            if event is None:
                return
            yield event
            async for event in decode:
                yield event
        finally:
            prefill.cancel()  # P should be done by now; if not, its request is aborted
            first.cancel()  # no-op unless a failure or the client's cancel came before D's first event
            await asyncio.gather(first, return_exceptions=True)
            await decode.aclose()

    async def _first(self, first: asyncio.Future, prefill: asyncio.Task, p: Replica, d: Replica):
        """D's first event (None: D ended without one). A failure of either side before it raises
        PairRetry or Passthrough."""
        done, _ = await asyncio.wait({first, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if first not in done and prefill.result() is not None:
            raise self._failed(PREFILL, p, prefill.result())
        try:
            return await first
        except StopAsyncIteration:
            return None
        except (Retry, Passthrough) as e:
            if prefill.done() and prefill.result() is not None:  # D's failure follows from P's
                raise self._failed(PREFILL, p, prefill.result()) from None
            raise self._failed(DECODE, d, (e.code, e.message)) from None

    @staticmethod
    def _failed(role: str, replica: Replica, failure: Failure) -> Exception:
        code, message = failure
        if role == PREFILL:
            log.warning("prefill side failed before the decode side streamed", extra={
                "replica": replica.address, "code": code.name, "error": message})
        if code in RETRYABLE:
            return PairRetry(role, replica, code, message)
        return Passthrough(code, f"{message} ({role} replica {replica.address})")

    async def _drain(self, replica: Replica, request: pb.GenerateTextRequest, version: Version) -> Failure | None:
        """P's stream, read to its end and discarded; its failure (an Error event or the call's
        status), or None. Ends P's attempt (its breaker's outcome)."""
        call = version.call(replica)(request)
        failure: Failure | None = None
        outcome: bool | None = None  # None: cancelled, or a failure that says nothing about P
        try:
            async for event in call:
                code = version.error_code(event)
                if code is not None:
                    failure = (code, event.error.message)
                    break
        except grpc.aio.AioRpcError as e:
            failure = (e.code(), e.details() or "")
        else:
            if failure is None:
                outcome = True
        finally:
            call.cancel()
            if failure is not None and failure[0] in REPLICA_FAULTS:
                outcome = False
            replica.end(outcome, failure[0].name if outcome is False else "")
            self.pools.prefill.update_readiness()
        return failure


def side_request(request: pb.GenerateTextRequest, rid: str, role: str, room: str,
                 bootstrap_address: str = "") -> pb.GenerateTextRequest:
    """The request as one side of the pair gets it (the tests and bench/disaggregation.py pair
    replicas with it too)."""
    out = pb.GenerateTextRequest()
    out.CopyFrom(request)
    out.rid = rid
    out.disaggregation.CopyFrom(cpb.Disaggregation(
        role=cpb.Disaggregation.PREFILL if role == PREFILL else cpb.Disaggregation.DECODE,
        room=room, bootstrap_address=bootstrap_address))
    return out
