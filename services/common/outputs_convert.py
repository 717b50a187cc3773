"""RequestOutput's parts ↔ radixmesh.v1 (common.proto): finish reasons, matched stops, logprobs.

The one place each is mapped: the scheduler encodes, the gateway decodes, and the
stages between pass the messages on. FinishReason.ERROR has no wire value: in the
mesh a failed request ends with an Error event (a gRPC status), not a Finish.
"""
from __future__ import annotations

from protos.radixmesh.v1 import common_pb2 as pb
from services.common.outputs import FinishReason, TokenLogprob, TopToken

_TO_PROTO = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
             FinishReason.ABORT: pb.FINISH_REASON_ABORT}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def finish_to_proto(index: int, reason: FinishReason | None, matched: int | str | None) -> pb.Finish:
    msg = pb.Finish(index=index, finish_reason=_TO_PROTO.get(reason, pb.FINISH_REASON_UNSPECIFIED))
    if isinstance(matched, str):
        msg.stop_str = matched
    elif isinstance(matched, int):
        msg.stop_token_id = matched
    return msg


def finish_reason_from_proto(value: int) -> FinishReason:
    """An unspecified (or newer) value reads as STOP: the sequence ended normally."""
    return _FROM_PROTO.get(value, FinishReason.STOP)


def matched_stop_from_proto(msg: pb.Finish) -> int | str | None:
    which = msg.WhichOneof("matched_stop")
    return getattr(msg, which) if which else None


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    msg = pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=[
        _named(pb.TokenLogprob.Top(token_id=t.token_id, logprob=t.logprob), t) for t in lp.top])
    return _named(msg, lp)


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, [TopToken(t.token_id, t.logprob, *_text(t)) for t in msg.top],
                        *_text(msg))


def _named(msg, lp: TokenLogprob | TopToken):
    if lp.token is not None:
        msg.token = lp.token
        msg.token_bytes = lp.bytes if lp.bytes is not None else lp.token.encode()
    return msg


def _text(msg) -> tuple[str | None, bytes | None]:
    """A logprob's token text and bytes; None when no stage named it (shown as token_id:<id>)."""
    return (msg.token, msg.token_bytes) if msg.HasField("token") else (None, None)
