"""The WorkerLink over the worker's gRPC Step stream, with the stall watchdog.

Plans are written as protobuf as they are sent; each result is read with a
bound (`bound_s(plan)` from when the worker started the plan): while it is
overdue the link reports the worker stalled (`stalled(reason)`), and
`stalled(None)` once it answers. While nothing is in flight a read stays open,
so a lost worker is seen at once. A broken stream raises WorkerLost.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from protos.radixmesh.v1 import common_pb2, worker_pb2
from services.common.grammar.constraint import Constraint
from services.common.sampling_params import InvalidRequest
from services.scheduler.worker_link import WorkerLost
from services.step.contract import StepPlan, StepResult
from services.step.convert import result_from_proto

log = logging.getLogger(__name__)


class GrpcStepLink:
    def __init__(self, call, to_proto: Callable[[StepPlan], worker_pb2.StepPlan],
                 bound_s: Callable[[StepPlan], float], stalled: Callable[[str | None], None],
                 stub=None) -> None:
        """call: the Step stream; stub: the WorkerStub, for the unary RPCs (PrepareGrammar)."""
        self._call, self._to_proto, self._bound_s, self._stalled = call, to_proto, bound_s, stalled
        self._stub = stub
        self._reading: asyncio.Future | None = None  # a read left open while idle

    async def send(self, plan: StepPlan) -> None:
        try:
            await self._call.write(self._to_proto(plan))
        except grpc.aio.AioRpcError as exc:
            raise _lost(exc) from exc

    async def receive(self, plan: StepPlan, started: float) -> StepResult:
        read, self._reading = self._reading or asyncio.ensure_future(self._call.read()), None
        try:
            msg = await self._watched(read, plan, started)
        except grpc.aio.AioRpcError as exc:
            raise _lost(exc) from exc
        finally:
            read.cancel()  # when the loop is cancelled; a no-op once done
        if msg is grpc.aio.EOF:
            raise WorkerLost("worker stream broke: the worker closed the step stream")
        return result_from_proto(msg)

    async def prepare_grammar(self, constraint: Constraint) -> None:
        try:
            await self._stub.PrepareGrammar(common_pb2.Constraint(kind=constraint.kind, spec=constraint.spec))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(exc.details()) from None
            raise RuntimeError(f"PrepareGrammar failed: {exc.code().name}: {exc.details()}") from None

    async def _watched(self, read: asyncio.Future, plan: StepPlan, started: float):
        """The read's message; while it is overdue the worker counts as stalled."""
        bound = self._bound_s(plan)
        done, _ = await asyncio.wait({read}, timeout=max(0.0, started + bound - time.monotonic()))
        if done:
            return read.result()  # raises what the read raised: the stream broke
        log.error("worker stalled", extra={"step_id": plan.step_id, "bound_s": round(bound, 3),
                                           "items": len(plan.items)})
        self._stalled(f"the worker has not answered step {plan.step_id} for more than {bound:.1f}s "
                      f"({len(plan.items)} requests in it)")
        await asyncio.wait({read})
        msg = read.result()
        log.info("worker answered again", extra={"step_id": plan.step_id,
                                                 "after_s": round(time.monotonic() - started, 3)})
        self._stalled(None)
        return msg

    async def idle(self, wake: asyncio.Event) -> None:
        self._reading = reading = self._reading or asyncio.ensure_future(self._call.read())
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({woken, reading}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if not reading.done():
            return
        self._reading = None
        try:
            msg = reading.result()  # raises what the read raised: the stream broke
        except grpc.aio.AioRpcError as exc:
            raise _lost(exc) from exc
        raise WorkerLost("worker stream broke: " + ("the worker closed the step stream" if msg is grpc.aio.EOF
                                                    else "the worker sent a step result nobody asked for"))

    def close(self) -> None:
        self._call.cancel()
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None


def _lost(exc: grpc.aio.AioRpcError) -> WorkerLost:
    return WorkerLost("worker stream broke: " + (exc.details() or exc.code().name))
