"""The detokenizer service. radixmesh.v2 (TextsServicer): the scheduler's outputs relayed to
the tokenizers with their text, one message per step (services/detokenizer/relay.py).
radixmesh.v1 (DetokenizerService): the Detokenize stream over IncrementalDetokenizer, still served.

v1: one stream per generation request, one IncrementalDetokenizer per sequence
index, created from the options of the index's first message. Exactly one
response answers each request message, in order, so a client can pair them
without ids. Decoding is a few microseconds of CPU per token, done on the
event loop.

Observability: a `detokenize` span per stream (messages and tokens counted on it,
no span per message), and Prometheus counters and a per-message time histogram.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry

from protos.radixmesh.v1 import detokenizer_pb2 as pb
from protos.radixmesh.v1 import detokenizer_pb2_grpc
from protos.radixmesh.v2 import detokenizer_pb2 as pb2
from protos.radixmesh.v2 import detokenizer_pb2_grpc as detokenizer2_grpc
from services.common import metrics as m
from services.common import tracing
from services.common.server import Readiness
from services.detokenizer.incremental import IncrementalDetokenizer
from services.detokenizer.relay import OutputRelay

log = logging.getLogger(__name__)


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, tokenizer) -> None:  # anything with decode(ids, skip_special_tokens)
        self.tokenizer = tokenizer
        self.model_name = "unknown"  # the metrics' label, set once the model is known
        r = self.registry = CollectorRegistry()
        self._streams = m.counter(r, "detokenizer_streams", "radixmesh.v1 Detokenize streams opened")
        self._requests = m.counter(r, "detokenizer_requests", "requests whose outputs were made text (radixmesh.v2)")
        self._tokens = m.counter(r, "detokenizer_tokens", "token ids turned into text")
        self._time = m.histogram(r, "detokenize_seconds", "one message's decoding time", m.ITL_BUCKETS)

    async def Detokenize(self, request_iterator: AsyncIterator[pb.DetokenizeRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeResponse]:
        self._streams.labels(self.model_name).inc()
        span = tracing.tracer().start_span("detokenize") if tracing.enabled() else None
        messages = tokens = 0
        try:
            async for resp in self._detokenize(request_iterator, context):
                messages += 1
                tokens += resp.tokens
                yield resp.response
        finally:
            if span is not None:
                span.set_attributes({"radixmesh.messages": messages, "radixmesh.tokens": tokens})
                span.end()

    async def _detokenize(self, request_iterator, context):
        sequences: dict[int, IncrementalDetokenizer] = {}
        done: set[int] = set()
        time_hist, token_count = self._time.labels(self.model_name), self._tokens.labels(self.model_name)
        async for req in request_iterator:
            index = req.index
            if index in done:
                yield _Answer(pb.DetokenizeResponse(index=index, done=True), 0)
                continue
            detok = sequences.get(index)
            if detok is None:
                if not req.HasField("options"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"the first message of index {index} must carry options")
                detok = sequences[index] = self._open(req.options)
            t0 = time.perf_counter()
            resp = self._answer(index, detok, req, sequences, done)
            time_hist.observe(time.perf_counter() - t0)
            token_count.inc(len(req.token_ids))
            yield _Answer(resp, len(req.token_ids))

    def _open(self, o: pb.DetokenizeOptions) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids=list(o.context_ids), stop=list(o.stop),
            skip_special_tokens=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
            include_stop_str_in_output=o.include_stop_str_in_output, min_tokens=o.min_tokens)
        # spaces_between_special_tokens: the tokenizers library decodes without that option

    @staticmethod
    def _answer(index: int, detok: IncrementalDetokenizer, req: pb.DetokenizeRequest,
                sequences: dict, done: set) -> pb.DetokenizeResponse:
        text = detok.push(list(req.token_ids)).text if req.token_ids else ""
        if req.finished and not detok.stopped:
            text += detok.flush()  # may itself complete a stop string
        resp = pb.DetokenizeResponse(index=index, text=text)
        if detok.stopped:
            resp.matched_stop = detok.matched_stop
        if detok.stopped or req.finished:
            resp.done = True
            done.add(index)
            del sequences[index]
        return resp


class _Answer:
    __slots__ = ("response", "tokens")

    def __init__(self, response: pb.DetokenizeResponse, tokens: int) -> None:
        self.response, self.tokens = response, tokens


class TextsServicer(detokenizer2_grpc.DetokenizerServicer):
    """radixmesh.v2.Detokenizer: each tokenizer's Texts stream, fed by an OutputRelay that follows
    the scheduler's Outputs (started by start(); `readiness` says whether it reads them)."""

    def __init__(self, service: DetokenizerService, readiness: Readiness) -> None:
        self.service, self.readiness = service, readiness
        self.relay: OutputRelay | None = None
        self._task: asyncio.Task | None = None

    def start(self, scheduler_addr: str) -> None:
        tokens = self.service._tokens.labels(self.service.model_name)
        requests = self.service._requests.labels(self.service.model_name)
        self.relay = OutputRelay(self.service.tokenizer, self.readiness, tokens.inc, requests.inc)
        self._task = asyncio.get_running_loop().create_task(self.relay.follow(scheduler_addr), name="outputs-relay")

    async def drain(self, deadline: float) -> None:
        """The requests in flight end, then the Texts streams, then following the scheduler."""
        if self.relay is not None:
            await self.relay.drain(deadline - 1.0)  # a second left to end the streams
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def Texts(self, request: pb2.TextsRequest, context: grpc.aio.ServicerContext):
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the detokenizer is still loading its tokenizer")
        if not request.subscriber:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "subscriber is required")
        async for batch in self.relay.texts(request.subscriber, context):
            yield batch
