"""radixmesh.v2.Tokenizer.Generate for test doubles written against v1's: each v1 event becomes
a v2 message (a chunk → an output; a Finish → an output with the finish; an Error → the error)."""
from __future__ import annotations

import grpc

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v2 import outputs_pb2 as opb
from protos.radixmesh.v2 import tokenizer_pb2 as pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc


def v2_response(event: cpb.GenerateResponse) -> pb2.GenerateResponse:
    kind = event.WhichOneof("event")
    if kind == "error":
        return pb2.GenerateResponse(error=event.error)
    if kind == "finish":
        return pb2.GenerateResponse(outputs=[opb.SequenceOutput(index=event.finish.index, finish=event.finish)])
    c = event.chunk
    return pb2.GenerateResponse(outputs=[opb.SequenceOutput(
        index=c.index, token_ids=c.token_ids, text=c.text, logprobs=c.logprobs, weights_version=c.weights_version,
        usage=cpb.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                        cached_tokens=c.cached_tokens, spec_verify_steps=c.spec_verify_steps,
                        spec_draft_tokens=c.spec_draft_tokens, spec_accepted_tokens=c.spec_accepted_tokens))])


class V2Generate(tokenizer2_grpc.TokenizerServicer):
    def __init__(self, v1) -> None:  # a radixmesh.v1 TokenizerServicer
        self.v1 = v1

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        async for event in self.v1.Generate(request, context):
            yield v2_response(event)

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Not served: a client falls back to Generate (as in front of a router)."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this double serves Generate only")
        yield  # an async generator, as grpc.aio expects of a streaming method


def add_both(servicer, server: grpc.aio.Server) -> None:
    """Serve `servicer`'s v1 Tokenizer and its Generate as v2."""
    from protos.radixmesh.v1 import tokenizer_pb2_grpc

    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    tokenizer2_grpc.add_TokenizerServicer_to_server(V2Generate(servicer), server)
