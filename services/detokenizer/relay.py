"""The detokenizer's part of the one-way output path (radixmesh.v2): the scheduler's Outputs in,
one OutputBatch per step; every sequence's text made by SequenceText (the Engine's code too);
each tokenizer's share out on its Texts stream, one OutputBatch per step.

Nothing waits on a reply. A stop string found here ends the sequence in the batch going out,
and the scheduler hears of it through an Abort-as-stop sent on the side; whatever it produced
for the sequence meanwhile is dropped here.

Faults: when the scheduler's stream breaks, every open request fails (UNAVAILABLE, to its
tokenizer), health goes NOT_SERVING and the relay reconnects. When a tokenizer's stream ends,
its requests are aborted at the scheduler (nobody is left to read them); their sequences are
forgotten as the aborts come back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import AsyncIterator

import grpc

from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import scheduler_pb2 as spb2
from protos.radixmesh.v2 import scheduler_pb2_grpc as scheduler2_grpc
from services.common import tracing
from services.common.batches import drain_batches
from services.common.outputs_convert import error_to_proto, output_from_proto, output_to_proto, text_options_from_proto
from services.common.server import Readiness
from services.common.side_calls import SideCalls
from services.detokenizer.sequence_text import SequenceText

log = logging.getLogger(__name__)

RECONNECT_S = 0.5


class OutputRelay:
    def __init__(self, tokenizer, readiness: Readiness, count_tokens=lambda n: None,
                 count_request=lambda: None) -> None:
        """tokenizer: decode(ids, skip_special_tokens) and token_text(id) (TextTokenizer)."""
        self.tokenizer, self.readiness = tokenizer, readiness
        self._count_tokens, self._count_request = count_tokens, count_request
        self._spans: dict[str, list] = {}  # rid -> [its "detokenize" span, tokens], when tracing
        self._sequences: dict[tuple[str, int], SequenceText] = {}
        self._open: dict[str, tuple[str, set[int]]] = {}  # rid -> (reply_to, indices with state here)
        self._subscribers: dict[str, asyncio.Queue] = {}
        self._scheduler: scheduler2_grpc.SchedulerStub | None = None
        self._aborts = SideCalls("abort at the scheduler")

    # --- the scheduler's side ---------------------------------------------------------------
    async def follow(self, scheduler_addr: str) -> None:
        """Forever: read the scheduler's Outputs, relay them; on a break fail what is open, retry."""
        channel = tracing.channel(scheduler_addr)
        self._scheduler = scheduler2_grpc.SchedulerStub(channel)
        self.readiness.set(False, f"not yet reading the scheduler's outputs at {scheduler_addr}")
        try:
            while True:
                reason = await self._read(self._scheduler.Outputs(spb2.OutputsRequest()))
                self.readiness.set(False, reason)
                self.fail_all(reason)
                await asyncio.sleep(RECONNECT_S)
        finally:
            await channel.close()

    async def _read(self, call) -> str:
        try:
            await call.initial_metadata()  # the scheduler sends it once we are its subscriber
            self.readiness.set(True)
            log.info("reading the scheduler's outputs")
            async for batch in call:
                for subscriber, out in self.relay(batch).items():
                    self._send(subscriber, out)
            return "the scheduler ended its outputs stream"
        except grpc.aio.AioRpcError as e:
            return f"the scheduler's outputs stream broke: {e.code().name} {e.details() or ''}".rstrip()
        finally:
            call.cancel()

    def relay(self, batch: opb.OutputBatch) -> dict[str, opb.OutputBatch]:
        """One scheduler batch → one batch per tokenizer, with text. Stop strings found here are
        sent to the scheduler on the side."""
        per: dict[str, opb.OutputBatch] = defaultdict(opb.OutputBatch)
        tokens = 0
        for msg in batch.outputs:
            tokens += len(msg.token_ids)
            made = self._text(msg)
            if made is not None:
                out, reply_to = made
                per[reply_to].outputs.append(out)
                self._forget_if_done(msg.rid, msg.index, out)
        for err in batch.errors:
            reply_to, _ = self._open.pop(err.rid, (err.reply_to, set()))
            self._drop(err.rid)
            per[reply_to or err.reply_to].errors.append(err)
        self._count_tokens(tokens)
        return per

    def _text(self, msg: opb.SequenceOutput) -> tuple[opb.SequenceOutput, str] | None:
        key = (msg.rid, msg.index)
        seq = self._sequences.get(key)
        if seq is None:
            if not msg.HasField("text_options"):
                return None  # ended here already (a stop string), or never ours
            options = text_options_from_proto(msg.text_options)
            seq = self._sequences[key] = SequenceText(self.tokenizer, options, self.tokenizer.token_text)
            if msg.rid not in self._open:
                self._opened(msg.rid, options.traceparent)
            self._open.setdefault(msg.rid, (options.reply_to, set()))[1].add(msg.index)
        if msg.rid in self._spans:
            self._spans[msg.rid][1] += len(msg.token_ids)
        out, stopped_here = seq.apply(output_from_proto(msg))
        if stopped_here:
            self._stop_at_scheduler(msg.rid, msg.index, out.matched_stop)
        return output_to_proto(out), seq.options.reply_to

    def _forget_if_done(self, rid: str, index: int, out: opb.SequenceOutput) -> None:
        if not out.HasField("finish"):
            return
        self._sequences.pop((rid, index), None)
        entry = self._open.get(rid)
        if entry is not None:
            entry[1].discard(index)
            if not entry[1]:
                del self._open[rid]
                self._closed(rid)

    def _drop(self, rid: str) -> None:
        for key in [k for k in self._sequences if k[0] == rid]:
            del self._sequences[key]
        self._closed(rid)

    def _opened(self, rid: str, traceparent: str) -> None:
        """A request's first output: counted, and its span started under the scheduler's."""
        self._count_request()
        if traceparent and tracing.enabled():
            span = tracing.tracer().start_span("detokenize", context=tracing.extract({"traceparent": traceparent}))
            self._spans[rid] = [span, 0]

    def _closed(self, rid: str) -> None:
        entry = self._spans.pop(rid, None)
        if entry is not None:
            entry[0].set_attribute("radixmesh.tokens", entry[1])
            entry[0].end()

    def fail_all(self, reason: str) -> None:
        """The scheduler's stream is gone: every open request fails at its tokenizer."""
        per: dict[str, opb.OutputBatch] = defaultdict(opb.OutputBatch)
        for rid, (reply_to, _) in self._open.items():
            per[reply_to].errors.append(error_to_proto(rid, grpc.StatusCode.UNAVAILABLE, reason, reply_to))
        for rid in list(self._open):
            self._closed(rid)
        self._open.clear()
        self._sequences.clear()
        for subscriber, out in per.items():
            self._send(subscriber, out)

    def _stop_at_scheduler(self, rid: str, index: int, matched: str) -> None:
        self._side_call(spb2.AbortRequest(rid=rid, index=index, as_stop=True, matched_stop=matched))

    def _side_call(self, request: spb2.AbortRequest) -> None:
        """An Abort that nothing waits for (a lost one costs the tokens the sequence still makes)."""
        if self._scheduler is not None:
            self._aborts.start(self._scheduler.Abort(request, timeout=10))

    # --- the tokenizers' side ---------------------------------------------------------------
    def _send(self, subscriber: str, batch: opb.OutputBatch) -> None:
        queue = self._subscribers.get(subscriber)
        if queue is not None and (batch.outputs or batch.errors):
            queue.put_nowait(batch)

    async def texts(self, subscriber: str, context: grpc.aio.ServicerContext) -> AsyncIterator[opb.OutputBatch]:
        """A tokenizer's stream: its requests' outputs, one message per step (more merged into one
        when it reads slower). A new stream under the same name replaces the old one."""
        old = self._subscribers.get(subscriber)
        if old is not None:
            old.put_nowait(None)
        queue = self._subscribers[subscriber] = asyncio.Queue()
        await context.send_initial_metadata(())  # tells the tokenizer it is subscribed
        try:
            async for batch in drain_batches(queue):
                yield batch
        finally:
            if self._subscribers.get(subscriber) is queue:
                del self._subscribers[subscriber]
                self._abort_requests_of(subscriber)

    async def drain(self, deadline: float, poll_s: float = 0.05) -> None:
        """Until the requests it carries have ended (or the deadline nears), then end every Texts
        stream, so the server's drain does not wait for long-lived calls to time out."""
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        for queue in self._subscribers.values():
            queue.put_nowait(None)

    def _abort_requests_of(self, subscriber: str) -> None:
        for rid, (reply_to, _) in list(self._open.items()):
            if reply_to == subscriber:
                self._side_call(spb2.AbortRequest(rid=rid))

