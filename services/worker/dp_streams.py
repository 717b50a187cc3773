"""The worker's Step streams under data-parallel attention (--enable-dp-attention): one per rank,
each from that rank's scheduler (radixmesh up starts one per rank), named by the stream's
`x-radixmesh-dp-rank` metadata.

A stream's plans join the group's rounds (services/worker/group/dp_rounds.py) as they arrive, and
their results go back in the stream's plan order; the rounds run on the worker's one step thread.
A new stream for a rank first drops that rank's requests (its scheduler knows none of them), and
waits for the rank's previous stream to end, as the plain Step stream does. Each plan gets the
worker.step span the plain stream gives it, with its rank (radixmesh.dp_rank).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import grpc

from protos.radixmesh.v1 import worker_pb2 as pb
from services.step.contract import DP_RANK_METADATA
from services.step.convert import plan_from_proto, result_to_proto
from services.worker.group.dp_rounds import DpRounds

log = logging.getLogger(__name__)


def stream_rank(context: grpc.aio.ServicerContext, size: int) -> int | None:
    """The rank a Step stream names (0 when it names none); None when it is not one of 0 .. size-1."""
    given = dict(context.invocation_metadata() or ()).get(DP_RANK_METADATA, "0")
    try:
        rank = int(given)
    except ValueError:
        return None
    return rank if 0 <= rank < size else None


class DpStreams:
    def __init__(self, runner, executor: ThreadPoolExecutor, takeover_s: float,
                 observe: Callable[[pb.StepPlan, float], None], span: Callable[[pb.StepPlan], object | None]) -> None:
        """observe(msg, seconds): a step's metrics; span(msg): its worker.step span (None: tracing off)."""
        self.rounds = DpRounds(runner, runner.dp_size)
        self._runner, self._executor, self._takeover_s, self._observe = runner, executor, takeover_s, observe
        self._span = span
        self._locks = [asyncio.Lock() for _ in range(runner.dp_size)]

    async def serve(self, request_iterator: AsyncIterator[pb.StepPlan],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResult]:
        rank = stream_rank(context, self.rounds.size)
        if rank is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{DP_RANK_METADATA} must name a data-parallel "
                                f"rank in 0..{self.rounds.size - 1} (--dp-size {self.rounds.size})")
        lock = self._locks[rank]
        try:
            await asyncio.wait_for(lock.acquire(), self._takeover_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"another scheduler holds data-parallel rank {rank}'s Step stream")
        loop = asyncio.get_running_loop()
        pending: asyncio.Queue = asyncio.Queue()
        reader = None
        try:
            try:
                await loop.run_in_executor(self._executor, self._runner.reset_rank, rank)
            except Exception as exc:  # a broken worker group: no step can run
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker cannot step: {exc}")
            log.info("step stream opened", extra={"peer": context.peer(), "dp_rank": rank})
            reader = asyncio.create_task(self._read(request_iterator, rank, pending, loop))
            while (item := await pending.get()) is not None:
                msg, started, span, result = item
                try:
                    out = await result
                except Exception as exc:
                    log.error("data-parallel rank %d: step %d failed", rank, msg.step_id, exc_info=exc)
                    _end_span(span, rank, exc=exc)
                    await context.abort(grpc.StatusCode.INTERNAL, f"worker step {msg.step_id} failed: {exc}")
                self._observe(msg, loop.time() - started)
                _end_span(span, rank, out.forward_seconds)
                yield result_to_proto(out)
            await reader
        finally:
            if reader is not None:
                reader.cancel()
            lock.release()

    async def _read(self, request_iterator, rank: int, pending: asyncio.Queue, loop) -> None:
        """Each plan into the rounds as it arrives; its future onto `pending`, in order."""
        try:
            async for msg in request_iterator:
                span = self._span(msg)  # from the plan's arrival: its wait for a round included
                ticket = self.rounds.enqueue(rank, plan_from_proto(msg))
                await pending.put((msg, loop.time(), span, loop.run_in_executor(self._executor, self.rounds.result,
                                                                                ticket)))
        finally:
            await pending.put(None)


def _end_span(span, rank: int, forward_seconds: float | None = None, exc: Exception | None = None) -> None:
    """End a step's worker.step span (None: tracing off), naming the rank it ran on."""
    if span is None:
        return
    span.set_attribute("radixmesh.dp_rank", rank)
    if forward_seconds is not None:
        span.set_attribute("radixmesh.forward_seconds", forward_seconds)
    if exc is not None:
        span.record_exception(exc)
    span.end()
