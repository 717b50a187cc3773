"""The proto contracts: generated code is fresh, and every dataclass field
of the step contract and of SamplingParams survives a trip through the wire.

No field is named here. The (dataclass, message) pairs are found by walking the
dataclasses' type hints beside the descriptors of the Step RPC's messages, and
each field's values are drawn from its proto type. A new step field touches the
dataclass (services/step/contract.py), the proto and services/step/convert.py;
this file changes only for a new *encoding* (the three tables below).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.radixmesh.v1 import common_pb2, worker_pb2
from services.common.convert import sampling_from_proto, sampling_to_proto
from services.common.sampling_params import SamplingParams
from services.step.contract import StepItem, StepPlan, StepResult
from services.step.convert import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto

REPO = Path(__file__).resolve().parents[2]

# Where the wire shape is not the dataclass's (services/step/convert.py, "Encoding notes").
TRANSPORT_ONLY = {"NewRequestSpec": {"traceparent"}}  # set by the service shells, not the core
SPLIT = {("SampledLogprobs", "top"): ("top_token_ids", "top_logprobs")}  # pairs as parallel arrays
WRAPPERS = {"LogprobSlot": "value"}  # a message whose field's presence encodes the dataclass's None

_INT_RANGES = {
    (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32): (-(2**31), 2**31 - 1),
    (FD.TYPE_UINT32, FD.TYPE_FIXED32): (0, 2**32 - 1),
    (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64): (-(2**63), 2**63 - 1),
    (FD.TYPE_UINT64, FD.TYPE_FIXED64): (0, 2**64 - 1),
}
_SCALARS = {t: st.integers(lo, hi) for types, (lo, hi) in _INT_RANGES.items() for t in types} | {
    FD.TYPE_DOUBLE: st.floats(allow_nan=False),  # NaN != NaN would defeat the equality check
    FD.TYPE_FLOAT: st.floats(width=32, allow_nan=False),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: st.text(max_size=12),
    FD.TYPE_BYTES: st.binary(max_size=32),
}


def _dataclass_in(hint):
    """The dataclass inside a type hint such as `list[X | None]`, or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next(filter(None, map(_dataclass_in, typing.get_args(hint))), None)


def _unwrap(desc):
    return desc.fields_by_name[WRAPPERS[desc.name]].message_type if desc.name in WRAPPERS else desc


def _mirrored(cls, desc) -> dict:
    """{dataclass: message descriptor} for cls and every dataclass its fields reach."""
    pairs = {cls: desc}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        fd = desc.fields_by_name.get(f.name)
        if fd is None or fd.message_type is None:
            continue  # a missing field fails test_proto_fields_mirror_the_dataclasses
        sub = _dataclass_in(hints[f.name])
        assert sub is not None, f"{cls.__name__}.{f.name} is a message on the wire but not a dataclass"
        pairs |= _mirrored(sub, _unwrap(fd.message_type))
    return pairs


_STEP = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Step"]
PAIRS = _mirrored(StepPlan, _STEP.input_type) | _mirrored(StepResult, _STEP.output_type)


def _field_values(cls, name: str, hint, desc) -> st.SearchStrategy:
    split = SPLIT.get((cls.__name__, name))
    if split:  # list[tuple]: one proto array per tuple position
        return st.lists(st.tuples(*(_SCALARS[desc.fields_by_name[n].type] for n in split)), max_size=4)
    fd = desc.fields_by_name[name]
    elem = typing.get_args(hint)[0] if fd.is_repeated else hint
    one = values(_dataclass_in(elem)) if fd.message_type is not None else _SCALARS[fd.type]
    if type(None) in typing.get_args(elem):
        one = st.none() | one
    return st.lists(one, max_size=4) if fd.is_repeated else one


def values(cls) -> st.SearchStrategy:
    """Instances of a mirrored dataclass, every field drawn from what its proto field holds."""
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _field_values(cls, f.name, hints[f.name], PAIRS[cls])
                             for f in dataclasses.fields(cls)})


def _wire_names(cls) -> set[str]:
    return {n for f in dataclasses.fields(cls) for n in SPLIT.get((cls.__name__, f.name), (f.name,))}


def test_generated_code_is_fresh() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_walk_reaches_every_step_dataclass() -> None:
    names = {cls.__name__ for cls in PAIRS}
    assert {"StepPlan", "NewRequestSpec", "StepItem", "KVCopy", "SamplingParams",
            "StepResult", "SampledLogprobs", "KVTransferStat"} <= names, names


@pytest.mark.parametrize("cls", list(PAIRS), ids=lambda cls: cls.__name__)
def test_proto_fields_mirror_the_dataclasses(cls) -> None:
    """A field added to a dataclass must be added to its message (and convert.py)."""
    desc = PAIRS[cls]
    wire = set(desc.fields_by_name) - TRANSPORT_ONLY.get(desc.name, set())
    assert _wire_names(cls) == wire, f"{cls.__name__} vs {desc.full_name}"


def _wire(msg):  # serialize and parse, so the test covers the encoding, not just the objects
    return type(msg).FromString(msg.SerializeToString())


@settings(max_examples=200, deadline=None)
@given(values(SamplingParams))
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert sampling_from_proto(_wire(sampling_to_proto(params))) == params


def test_unset_sampling_fields_take_the_dataclass_defaults() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    partial = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=0))
    assert partial == SamplingParams(temperature=0.0, top_k=0)
    # An explicit zero is not "unset": it must not fall back to a non-zero default.
    assert partial.temperature == 0.0 and partial.top_p == 1.0 and partial.top_k == 0


def test_seed_none_is_unset_on_the_wire() -> None:
    msg = sampling_to_proto(SamplingParams(seed=None))
    assert not msg.HasField("seed")
    assert sampling_from_proto(msg).seed is None


@settings(max_examples=200, deadline=None)
@given(values(StepPlan))
def test_step_plan_round_trip(plan: StepPlan) -> None:
    assert plan_from_proto(_wire(plan_to_proto(plan))) == plan


@settings(max_examples=200, deadline=None)
@given(values(StepResult))
def test_step_result_round_trip(result: StepResult) -> None:
    back = result_from_proto(_wire(result_to_proto(result)))
    assert back == result
    assert all(isinstance(pair, tuple) for lp in back.logprobs if lp for pair in lp.top)


def test_step_item_sample_costs_nothing_when_true() -> None:
    """The common case (sample=True) is left unset, so it adds no bytes."""
    plan = StepPlan(step_id=1, items=[StepItem("a", [5], 3, [], sample=True),
                                      StepItem("b", [5], 3, [], sample=False)])
    msg = plan_to_proto(plan)
    assert not msg.items[0].HasField("sample")
    assert msg.items[1].HasField("sample") and not msg.items[1].sample


def test_mismatched_top_logprob_arrays_are_rejected() -> None:
    bad = worker_pb2.StepResult(logprobs=[worker_pb2.LogprobSlot(
        value=worker_pb2.SampledLogprobs(logprob=-1.0, top_token_ids=[1, 2], top_logprobs=[-1.0]))])
    with pytest.raises(ValueError, match="same length"):
        result_from_proto(bad)
