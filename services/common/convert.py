"""SamplingParams ↔ radixmesh.v1.SamplingParams.

Contract: every scalar of the proto is `optional`; an unset field takes the
dataclass default, so `sampling_from_proto(SamplingParams())` equals
`SamplingParams()` and a sender only pins what it sets. `seed=None` is sent as
unset. No validation happens here: values travel as given and
`SamplingParams.validate` (at the stage that knows the vocabulary) raises the
user-facing error. Out-of-range integers (outside int32/int64) raise
ValueError from protobuf.
"""
from __future__ import annotations

from dataclasses import fields

from protos.radixmesh.v1 import common_pb2 as pb
from services.common.grammar.constraint import Constraint
from services.common.sampling_params import SamplingParams

_REPEATED = ("stop_token_ids", "stop")
_MESSAGES = ("constraint",)
_SCALARS = tuple(f.name for f in fields(SamplingParams) if f.name not in _REPEATED + _MESSAGES)


def sampling_to_proto(params: SamplingParams, *, unset_max_new_tokens: bool = False) -> pb.SamplingParams:
    """Every scalar that is not None is set explicitly, so the receiver needs no
    knowledge of the sender's defaults. `unset_max_new_tokens` leaves
    max_new_tokens out (whatever `params` holds): the tokenizer's Generate then
    gives the request what the context leaves after the prompt."""
    scalars = {name: getattr(params, name) for name in _SCALARS}
    if unset_max_new_tokens:
        del scalars["max_new_tokens"]
    c = params.constraint
    return pb.SamplingParams(
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        constraint=None if c is None else pb.Constraint(kind=c.kind, spec=c.spec),
        **{name: value for name, value in scalars.items() if value is not None},
    )


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optionals keep the dataclass defaults; lists are copied."""
    present = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    constraint = Constraint(msg.constraint.kind, msg.constraint.spec) if msg.HasField("constraint") else None
    return SamplingParams(stop_token_ids=list(msg.stop_token_ids), stop=list(msg.stop), constraint=constraint,
                          **present)
