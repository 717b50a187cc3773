"""One Generate request through the replica: scheduler stream → detokenizer stream → client.

The scheduler streams token-id chunks and Finish events per sequence; each
chunk goes to the detokenizer (one bidi stream per request, one response per
message, so pairing is by order) and comes back out with its text delta. A
chunk's `finish` (set by the scheduler on a sequence's last chunk) says what
the detokenizer must do at once: flush held-back text, and leave out a stop
token (EOS or a stop_token_id), which has no text.

When the detokenizer reports a stop string, the sequence ends here with
FINISH_REASON_STOP and the matched string; the scheduler is told with an
Abort-as-stop so that it frees the KV and counts the request finished, and
whatever it still sends for that sequence is dropped.
"""
from __future__ import annotations

from typing import AsyncIterator, Callable

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import detokenizer_pb2 as dpb
from protos.radixmesh.v1 import scheduler_pb2 as spb

CONTEXT_IDS = 8  # prompt tail sent as decoding context (the detokenizer keeps what it needs)


class StageError(Exception):
    """A downstream stage failed the request: (grpc code, message)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Pipeline:
    """Yields the client's events; raises StageError when the scheduler refuses the request
    before any event (validation, queue full) so the caller can fail the call with its code."""

    def __init__(self, rid: str, prompt_ids: list[int], request, scheduler, detokenizer,
                 token_text: Callable[[int], tuple[str, bytes]] | None = None) -> None:
        self.rid, self.request = rid, request  # a tokenizer_pb2.GenerateTextRequest
        self._token_text = token_text  # id → (text, bytes), for logprobs (TextTokenizer.token_text)
        self.prompt_ids = prompt_ids
        self.n = request.n if request.HasField("n") else 1
        self._scheduler, self._detokenizer = scheduler, detokenizer  # stubs
        self._options = dpb.DetokenizeOptions(
            stop=request.sampling.stop, include_stop_str_in_output=request.include_stop_str_in_output,
            context_ids=prompt_ids[-CONTEXT_IDS:], min_tokens=max(request.sampling.min_new_tokens, 0))
        if request.HasField("skip_special_tokens"):
            self._options.skip_special_tokens = request.skip_special_tokens
        self._started: set[int] = set()  # indices the detokenizer has seen
        self._done: set[int] = set()
        self._counts = cpb.GenerateChunk()  # latest request-level counters
        self.sched_call = None
        self.detok_call = None

    def cancel(self) -> None:
        """Cancel both downstream calls (no-op once they ended); the scheduler aborts what is open."""
        for call in (self.sched_call, self.detok_call):
            if call is not None:
                call.cancel()

    async def run(self) -> AsyncIterator[cpb.GenerateResponse]:
        sreq = spb.GenerateRequest(rid=self.rid, input_ids=self.prompt_ids, sampling=self.request.sampling,
                                   namespace=self.request.namespace, adapter=self.request.adapter)
        if self.request.HasField("n"):
            sreq.n = self.request.n
        self.sched_call = self._scheduler.Generate(sreq)
        seen_any = False
        try:
            async for ev in self.sched_call:
                seen_any = True
                kind = ev.WhichOneof("event")
                if kind == "error":
                    yield ev
                    return
                events = await (self._chunk(ev.chunk) if kind == "chunk" else self._finish(ev.finish))
                for out in events:
                    yield out
                if len(self._done) == self.n:
                    return
        except grpc.aio.AioRpcError as e:
            if not seen_any:
                raise StageError(e.code(), e.details() or e.code().name) from e
            yield _error(e.code(), f"scheduler: {e.details()}")
            return
        except StageError as e:  # the detokenizer failed mid-stream
            yield _error(e.code, e.message)
            return
        if len(self._done) < self.n:
            yield _error(grpc.StatusCode.INTERNAL, "the scheduler stream ended before every sequence finished")

    async def _chunk(self, c: cpb.GenerateChunk) -> list[cpb.GenerateResponse]:
        if c.index in self._done:
            return []  # tokens past a stop string that the scheduler produced before it heard
        self._counts = c
        fin = c.finish if c.HasField("finish") else None
        ids = list(c.token_ids)
        visible = ids[:-1] if _ends_with_stop_token(fin, ids) else ids
        resp = await self._detokenize(c.index, visible, finished=fin is not None)
        out = cpb.GenerateChunk(index=c.index, token_ids=ids, text=resp.text, logprobs=c.logprobs,
                                weights_version=c.weights_version, **_counters(c))
        if self._token_text is not None:
            for lp in out.logprobs:
                lp.token, lp.token_bytes = self._token_text(lp.token_id)
                for top in lp.top:
                    top.token, top.token_bytes = self._token_text(top.token_id)
        if resp.HasField("matched_stop"):
            fin = cpb.Finish(index=c.index, finish_reason=cpb.FINISH_REASON_STOP, stop_str=resp.matched_stop)
            if not c.HasField("finish"):  # still running at the scheduler: end it as finished
                await self._stop_at_scheduler(c.index, resp.matched_stop)
        if fin is None:
            return [cpb.GenerateResponse(chunk=out)]
        self._done.add(c.index)
        out.finish.CopyFrom(fin)
        return [cpb.GenerateResponse(chunk=out), cpb.GenerateResponse(finish=fin)]

    async def _finish(self, f: cpb.Finish) -> list[cpb.GenerateResponse]:
        """A Finish without a final chunk (abort, or the separate copy of a chunk's finish)."""
        if f.index in self._done:
            return []
        self._done.add(f.index)
        events = []
        if f.index in self._started:  # release text the detokenizer held back
            resp = await self._detokenize(f.index, [], finished=True)
            if resp.text:
                events.append(cpb.GenerateResponse(chunk=cpb.GenerateChunk(
                    index=f.index, text=resp.text, **_counters(self._counts))))
        events.append(cpb.GenerateResponse(finish=f))
        return events

    async def _detokenize(self, index: int, ids: list[int], finished: bool) -> dpb.DetokenizeResponse:
        req = dpb.DetokenizeRequest(index=index, token_ids=ids, finished=finished)
        if index not in self._started:
            req.options.CopyFrom(self._options)
            self._started.add(index)
        try:
            if self.detok_call is None:
                self.detok_call = self._detokenizer.Detokenize()
            await self.detok_call.write(req)
            resp = await self.detok_call.read()
        except grpc.aio.AioRpcError as e:
            raise StageError(e.code(), f"detokenizer: {e.details()}") from e
        if resp is grpc.aio.EOF:
            raise StageError(grpc.StatusCode.INTERNAL, "detokenizer: the stream ended early")
        return resp

    async def _stop_at_scheduler(self, index: int, matched: str) -> None:
        try:
            await self._scheduler.Abort(spb.AbortRequest(rid=self.rid, index=index, as_stop=True,
                                                         matched_stop=matched), timeout=10)
        except grpc.aio.AioRpcError:
            pass  # cancelling the stream (the caller's cleanup) aborts it anyway


# The request-level counters of a chunk (common.proto): each new chunk repeats the latest.
COUNTERS = ("prompt_tokens", "completion_tokens", "cached_tokens",
            "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


def _counters(c: cpb.GenerateChunk) -> dict[str, int]:
    return {name: getattr(c, name) for name in COUNTERS}


def _ends_with_stop_token(fin: cpb.Finish | None, ids: list[int]) -> bool:
    return (fin is not None and fin.finish_reason == cpb.FINISH_REASON_STOP
            and fin.WhichOneof("matched_stop") == "stop_token_id" and bool(ids) and ids[-1] == fin.stop_token_id)


def _error(code: grpc.StatusCode, message: str) -> cpb.GenerateResponse:
    return cpb.GenerateResponse(error=cpb.Error(code=code.value[0], message=message))
