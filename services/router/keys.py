"""The routing key: what the approximate prefix tree (and so cache_aware) sees of a request."""
from __future__ import annotations

from protos.radixmesh.v1 import tokenizer_pb2 as pb


def routing_key(request: pb.GenerateTextRequest) -> str:
    """The namespace, the adapter, then the prompt as the replica will render it (conversation
    turns in order; token ids as one character each)."""
    which = request.WhichOneof("prompt")
    if which == "text":
        body = request.text
    elif which == "conversation":
        body = "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.conversation.messages)
    elif which == "input_ids":
        body = "".join(chr(0x100 + (i % 0x10F000)) for i in request.input_ids.ids)
    else:
        body = ""
    return f"{request.namespace}\x00{request.adapter}\x00{body}"
