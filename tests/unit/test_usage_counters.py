"""A request's usage counters, scheduler → tokenizer → gateway, over the wire.

Which counters there are is read from the descriptors: every uint64 of GenerateChunk is a
request-level counter, which the tokenizer copies onto each chunk it sends on
(pipeline.COUNTERS), Usage totals and RequestOutput carries under the same name. A new
counter added to the proto but not to one of those fails here.
"""
from __future__ import annotations

import dataclasses

from google.protobuf.descriptor import FieldDescriptor as FD

from protos.radixmesh.v1 import common_pb2 as cpb
from services.common.outputs import FinishReason, RequestOutput
from services.gateway.backend import _event
from services.scheduler.convert import SPEC_COUNTERS, Usage, output_events
from services.scheduler.main import SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from services.tokenizer.pipeline import COUNTERS, _counters

CHUNK_COUNTERS = {f.name for f in cpb.GenerateChunk.DESCRIPTOR.fields if f.type == FD.TYPE_UINT64}


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_every_counter_is_copied_totalled_and_carried():
    assert set(COUNTERS) == CHUNK_COUNTERS
    assert set(cpb.Usage.DESCRIPTOR.fields_by_name) == CHUNK_COUNTERS
    assert CHUNK_COUNTERS <= {f.name for f in dataclasses.fields(RequestOutput)}
    assert set(SPEC_COUNTERS) <= CHUNK_COUNTERS


def _out(index: int, completion: int, spec: tuple[int, int, int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [] if finished else [7], index=index, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, prompt_tokens=5,
                         completion_tokens=completion, cached_tokens=2 + index,
                         **dict(zip(SPEC_COUNTERS, spec)))


def test_counters_reach_the_gateway_summed_over_sequences():
    """Two sequences' cumulative counters: the scheduler's chunk sums them (cached: the least),
    the tokenizer copies them onto its chunk, the gateway's event carries them."""
    usage = Usage()
    output_events(0, _out(0, 3, (3, 9, 6)), usage)
    (chunk,) = output_events(1, _out(1, 2, (2, 6, 1)), usage)
    sent_on = cpb.GenerateChunk(index=1, text="x", **_counters(_wire(chunk).chunk))
    event = _event("r", _wire(cpb.GenerateResponse(chunk=sent_on)))
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (5, 5, 2)
    assert (event.spec_verify_steps, event.spec_draft_tokens, event.spec_accepted_tokens) == (5, 15, 7)


def test_counters_are_zero_on_the_wire_when_nothing_speculated():
    (chunk,) = output_events(0, _out(0, 1, (0, 0, 0)), Usage())
    assert chunk.chunk.ByteSize() == cpb.GenerateChunk(index=0, token_ids=[7], prompt_tokens=5, completion_tokens=1,
                                                       cached_tokens=2).ByteSize()


def test_the_schedulers_total_usage_adds_finished_requests_counters():
    svc = SchedulerService(SchedulerServiceConfig())
    svc._deliver([_out(0, 4, (2, 6, 3), finished=True), _out(1, 1, (0, 0, 0), finished=True),
                  _out(0, 9, (9, 9, 9))])  # not finished: not counted yet
    u = svc._usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (10, 5, 5)
    assert (u.spec_verify_steps, u.spec_draft_tokens, u.spec_accepted_tokens) == (2, 6, 3)
