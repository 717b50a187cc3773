"""The proto contracts: generated code is fresh, and every dataclass field
of the step contract and of SamplingParams survives a trip through the wire."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.radixmesh.v1 import common_pb2, worker_pb2
from services.common.convert import sampling_from_proto, sampling_to_proto
from services.common.sampling_params import SamplingParams
from services.scheduler.step_plan import (
    NewRequestSpec,
    StepItem,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from services.worker.convert import (
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
)

REPO = Path(__file__).resolve().parents[2]

INT32 = st.integers(-(2**31), 2**31 - 1)
IDS = st.lists(st.integers(0, 2**31 - 1), max_size=8)  # token ids, page indices
FLOATS = st.floats(allow_nan=False)  # NaN != NaN would defeat the equality check
RIDS = st.text(max_size=12)


def test_generated_code_is_fresh() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_proto_fields_mirror_the_dataclasses() -> None:
    """A field added to a dataclass must be added to its message (and convert.py)."""
    pairs = [(SamplingParams, common_pb2.SamplingParams), (NewRequestSpec, worker_pb2.NewRequestSpec),
             (StepItem, worker_pb2.StepItem), (StepPlan, worker_pb2.StepPlan),
             (StepResult, worker_pb2.StepResult)]
    # Set by the service shells, not the core: the request span the worker's step spans link to.
    transport_only = {worker_pb2.NewRequestSpec: {"traceparent"}}
    for cls, msg in pairs:
        wire = set(msg.DESCRIPTOR.fields_by_name) - transport_only.get(msg, set())
        assert {f.name for f in dataclasses.fields(cls)} == wire, cls


sampling_params = st.builds(
    SamplingParams,
    max_new_tokens=INT32, min_new_tokens=INT32, temperature=FLOATS, top_p=FLOATS, top_k=INT32,
    min_p=FLOATS, repetition_penalty=FLOATS, frequency_penalty=FLOATS, presence_penalty=FLOATS,
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop_token_ids=st.lists(INT32, max_size=4), stop=st.lists(st.text(max_size=8), max_size=3),
    ignore_eos=st.booleans(), logprobs=st.booleans(), top_logprobs=INT32,
)


def _wire(msg):  # serialize and parse, so the test covers the encoding, not just the objects
    return type(msg).FromString(msg.SerializeToString())


@settings(max_examples=200, deadline=None)
@given(sampling_params)
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


new_requests = st.builds(
    NewRequestSpec, rid=RIDS, prompt_ids=IDS, output_ids=IDS, sampling=sampling_params,
    seed=st.integers(0, 2**63 - 1))
step_items = st.builds(
    StepItem, rid=RIDS, input_ids=IDS, start_pos=st.integers(0, 2**32 - 1), new_pages=IDS,
    reset_pages=st.booleans(), sample=st.booleans())
step_plans = st.builds(
    StepPlan, step_id=st.integers(0, 2**64 - 1), new_requests=st.lists(new_requests, max_size=3),
    items=st.lists(step_items, max_size=4), released_rids=st.lists(RIDS, max_size=3))
token_logprobs = st.builds(
    TokenLogprobs, logprob=FLOATS,
    top=st.lists(st.tuples(st.integers(0, 2**31 - 1), FLOATS), max_size=5))
step_results = st.builds(
    StepResult, step_id=st.integers(0, 2**64 - 1), rids=st.lists(RIDS, max_size=4),
    next_token_ids=IDS, logprobs=st.lists(st.none() | token_logprobs, max_size=4),
    forward_seconds=FLOATS)


@settings(max_examples=200, deadline=None)
@given(step_plans)
def test_step_plan_round_trip(plan: StepPlan) -> None:
    assert plan_from_proto(_wire(plan_to_proto(plan))) == plan


@settings(max_examples=200, deadline=None)
@given(step_results)
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
