"""The detokenizer service: the Detokenize stream over IncrementalDetokenizer.

One stream per generation request, one IncrementalDetokenizer per sequence
index, created from the options of the index's first message. Exactly one
response answers each request message, in order, so a client can pair them
without ids. Decoding is a few microseconds of CPU per token, done on the
event loop.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import detokenizer_pb2 as pb
from protos.radixmesh.v1 import detokenizer_pb2_grpc
from services.detokenizer.incremental import IncrementalDetokenizer

log = logging.getLogger(__name__)


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, tokenizer) -> None:  # anything with decode(ids, skip_special_tokens)
        self.tokenizer = tokenizer

    async def Detokenize(self, request_iterator: AsyncIterator[pb.DetokenizeRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DetokenizeResponse]:
        sequences: dict[int, IncrementalDetokenizer] = {}
        done: set[int] = set()
        async for req in request_iterator:
            index = req.index
            if index in done:
                yield pb.DetokenizeResponse(index=index, done=True)
                continue
            detok = sequences.get(index)
            if detok is None:
                if not req.HasField("options"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"the first message of index {index} must carry options")
                detok = sequences[index] = self._open(req.options)
            yield self._answer(index, detok, req, sequences, done)

    def _open(self, o: pb.DetokenizeOptions) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids=list(o.context_ids), stop=list(o.stop),
            skip_special_tokens=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
            include_stop_str_in_output=o.include_stop_str_in_output)
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
