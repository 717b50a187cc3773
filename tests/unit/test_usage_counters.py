"""A request's usage counters, scheduler → detokenizer → tokenizer → gateway, over the wire.

Which counters there are is read from the descriptors: every field of common.proto's Usage is
a request-level counter, which RequestOutput carries under the same name and OpenRequests sums
over a request's sequences. A new counter added to the proto but not to those fails here.
"""
from __future__ import annotations

import dataclasses

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v2 import tokenizer_pb2 as tpb2
from services.common.outputs import SPEC_COUNTERS, FinishReason, RequestOutput
from services.common.outputs_convert import output_to_proto
from services.common.sampling_params import SamplingParams
from services.gateway.backend import events
from services.scheduler.main import SchedulerServiceConfig
from services.scheduler.open_requests import OpenRequests
from services.scheduler.service import SchedulerService

USAGE_COUNTERS = set(cpb.Usage.DESCRIPTOR.fields_by_name)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_every_counter_is_carried_and_summed():
    assert USAGE_COUNTERS <= {f.name for f in dataclasses.fields(RequestOutput)}
    assert set(SPEC_COUNTERS) <= USAGE_COUNTERS


class _Core:
    def submit(self, *args, **kwargs) -> None:
        pass


def _out(crid: str, completion: int, spec: tuple[int, int, int], finished: bool = False,
         cached: int = 2) -> RequestOutput:
    return RequestOutput(crid, [] if finished else [7], finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, prompt_tokens=5,
                         completion_tokens=completion, cached_tokens=cached, **dict(zip(SPEC_COUNTERS, spec)))


def test_counters_reach_the_gateway_summed_over_sequences():
    """Two sequences' cumulative counters: the request's output sums them (cached: the least),
    and the gateway's event carries them."""
    requests = OpenRequests()
    requests.submit(_Core(), "r", [1, 2], SamplingParams(), n=2)
    requests.route([_out("r/0", 3, (3, 9, 6), cached=2)])
    ((_, out),) = requests.route([_out("r/1", 2, (2, 6, 1), cached=3)])
    (event,) = events(_wire(tpb2.GenerateResponse(outputs=[output_to_proto(out)])))
    assert (event.rid, event.index) == ("r", 1)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (5, 5, 2)
    assert (event.spec_verify_steps, event.spec_draft_tokens, event.spec_accepted_tokens) == (5, 15, 7)


def test_counters_are_zero_on_the_wire_when_nothing_speculated():
    msg = output_to_proto(_out("r", 1, (0, 0, 0)))
    assert msg.usage.ByteSize() == cpb.Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=2).ByteSize()


def test_the_schedulers_total_usage_adds_finished_requests_counters():
    svc = SchedulerService(SchedulerServiceConfig())
    svc.core = type("Core", (), {"limits": type("L", (), {"weights_version": "0"})(),
                                 "prefill_rooms": None, "decode_rooms": None})()
    svc._deliver([_out("a", 4, (2, 6, 3), finished=True), _out("b", 1, (0, 0, 0), finished=True),
                  _out("a", 9, (9, 9, 9))])  # not finished: not counted yet
    u = svc._usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (10, 5, 4)
    assert (u.spec_verify_steps, u.spec_draft_tokens, u.spec_accepted_tokens) == (2, 6, 3)
