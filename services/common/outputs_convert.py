"""RequestOutput and its parts ↔ protobuf: radixmesh.v1 (common.proto: finish reasons, matched
stops, logprobs, usage) and radixmesh.v2 (outputs.proto: a sequence's output, text options).

The one place each is mapped: the scheduler encodes, the detokenizer decodes and re-encodes
with the text, the tokenizer passes the messages on, the gateway decodes. FinishReason.ERROR
has no wire value: in the mesh a failed request ends with an error (a gRPC status), not a Finish.
"""
from __future__ import annotations

from protos.radixmesh.v1 import common_pb2 as pb
from protos.radixmesh.v2 import outputs_pb2 as v2
from services.common.outputs import FinishReason, RequestOutput, TokenLogprob, TopToken, spec_counters
from services.common.text_options import TextOptions

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
    msg = pb.TokenLogprob(token_id=lp.token_id, top=[
        _named(pb.TokenLogprob.Top(token_id=t.token_id, logprob=t.logprob), t) for t in lp.top])
    if lp.logprob is not None:  # None: a prompt's first token
        msg.logprob = lp.logprob
    return _named(msg, lp)


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob if msg.HasField("logprob") else None,
                        [TopToken(t.token_id, t.logprob, *_text(t)) for t in msg.top], *_text(msg))


def _named(msg, lp: TokenLogprob | TopToken):
    if lp.token is not None:
        msg.token = lp.token
        msg.token_bytes = lp.bytes if lp.bytes is not None else lp.token.encode()
    return msg


def _text(msg) -> tuple[str | None, bytes | None]:
    """A logprob's token text and bytes; None when no stage named it (shown as token_id:<id>)."""
    return (msg.token, msg.token_bytes) if msg.HasField("token") else (None, None)


# --- radixmesh.v2 (outputs.proto): a whole output, and how its ids become text ----------------

def usage_to_proto(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    cached_tokens=out.cached_tokens, **spec_counters(out))


def output_to_proto(out: RequestOutput, weights_version: str = "") -> v2.SequenceOutput:
    """A sequence's output (its text, if a stage made it); an ERROR output has no wire form here:
    the request fails with a RequestError (error_to_proto)."""
    msg = v2.SequenceOutput(rid=out.rid, index=out.index, token_ids=out.token_ids, text=out.text,
                            usage=usage_to_proto(out), weights_version=out.weights_version or weights_version)
    if out.logprobs:
        msg.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    if out.embedding:
        msg.embedding.extend(out.embedding)
    if out.finished:
        msg.finish.CopyFrom(finish_to_proto(out.index, out.finish_reason, out.matched_stop))
    return msg


def output_from_proto(msg: v2.SequenceOutput) -> RequestOutput:
    u = msg.usage
    out = RequestOutput(msg.rid, list(msg.token_ids), [logprob_from_proto(lp) for lp in msg.logprobs], msg.text,
                        msg.index, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                        cached_tokens=u.cached_tokens, spec_verify_steps=u.spec_verify_steps,
                        spec_draft_tokens=u.spec_draft_tokens, spec_accepted_tokens=u.spec_accepted_tokens,
                        weights_version=msg.weights_version,
                        prompt_logprobs=[logprob_from_proto(lp) for lp in msg.prompt_logprobs],
                        embedding=list(msg.embedding))
    if msg.HasField("finish"):
        out.finished = True
        out.finish_reason = finish_reason_from_proto(msg.finish.finish_reason)
        out.matched_stop = matched_stop_from_proto(msg.finish)
    return out


def error_to_proto(rid: str, code, message: str, reply_to: str = "") -> v2.RequestError:
    """code: a grpc.StatusCode."""
    return v2.RequestError(rid=rid, error=pb.Error(code=code.value[0], message=message), reply_to=reply_to)


def text_options_to_proto(o: TextOptions) -> v2.TextOptions:
    return v2.TextOptions(stop=o.stop, skip_special_tokens=o.skip_special_tokens,
                          include_stop_str_in_output=o.include_stop_str_in_output, context_ids=o.context_ids,
                          min_tokens=o.min_tokens, reply_to=o.reply_to, traceparent=o.traceparent)


def text_options_from_proto(msg: v2.TextOptions) -> TextOptions:
    return TextOptions(tuple(msg.stop), msg.skip_special_tokens, msg.include_stop_str_in_output,
                       tuple(msg.context_ids), msg.min_tokens, msg.reply_to, msg.traceparent)
