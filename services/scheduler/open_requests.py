"""Client requests over the scheduler core: n sequences per request, request-level usage.

The core schedules sequences; a client asks for a request of `n` of them (OpenAI's n). This
is the one place that maps between the two, for the scheduler service and the in-process
Engine alike:

- a request of n sequences is n core requests, `rid` (n = 1) or `rid/0` .. `rid/n-1`, seeded
  seed, seed+1, ... (so each is reproducible alone), submitted all or none;
- the core's outputs come back under the request's rid and the sequence's `index`, with the
  request's counters: the prompt once, completion and speculative counts summed over the
  sequences, cached tokens the least any sequence reused (the prompt was computed at least once);
- a sequence is open until its finishing output; an error output fails the whole request.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.outputs import SPEC_COUNTERS, FinishReason, RequestOutput, spec_counters
from services.common.request_limits import MAX_N
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.outputs import QueueFull

SEED_MOD = 2**63


@dataclass
class Usage:
    """A request's counters over its sequences."""
    prompt_tokens: int = 0
    completion: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    spec: dict[int, tuple[int, ...]] = field(default_factory=dict)  # index -> SPEC_COUNTERS

    def update(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion[index] = out.completion_tokens
        self.cached[index] = out.cached_tokens
        self.spec[index] = tuple(spec_counters(out).values())

    def request_level(self, out: RequestOutput, **fields) -> RequestOutput:
        """A copy of `out` with the request's counters in place of its sequence's (and `fields`)."""
        spec = {name: sum(counts[i] for counts in self.spec.values()) for i, name in enumerate(SPEC_COUNTERS)}
        return replace(out, prompt_tokens=self.prompt_tokens, completion_tokens=sum(self.completion.values()),
                       cached_tokens=min(self.cached.values(), default=0), **spec, **fields)


@dataclass(eq=False)
class OpenRequest:
    rid: str
    core_rids: list[str]
    owner: Any = None  # whoever receives its outputs (a subscriber, a call, a handle)
    open: set[int] = field(default_factory=set)
    usage: Usage = field(default_factory=Usage)

    @property
    def done(self) -> bool:
        return not self.open


def sequence_rids(rid: str, n: int) -> list[str]:
    return [rid] if n == 1 else [f"{rid}/{i}" for i in range(n)]


class OpenRequests:
    def __init__(self) -> None:
        self.requests: dict[str, OpenRequest] = {}
        self._sequences: dict[str, tuple[OpenRequest, int]] = {}  # core rid -> (request, index)

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, rid: str) -> bool:
        return rid in self.requests

    def submit(self, core, rid: str, ids: list[int], sampling: SamplingParams, n: int = 1,
               namespace: str = "", adapter: str = "", owner: Any = None, pd=None) -> OpenRequest:
        """Queue the request's n sequences in `core` (a Scheduler), all or none. Raises
        InvalidRequest or QueueFull with nothing queued. pd: its part in a disaggregated pair
        (services/scheduler/disaggregation.PDSpec), one sequence only."""
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
        if pd is not None and n != 1:
            raise InvalidRequest(f"n > 1 is not served by disaggregated replicas, got n={n}")
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        req = OpenRequest(rid, sequence_rids(rid, n), owner, set(range(n)))
        submitted: list[str] = []
        try:
            for i, crid in enumerate(req.core_rids):
                core.submit(crid, ids, sampling, (seed + i) % SEED_MOD, namespace, adapter, pd=pd)
                submitted.append(crid)
        except (QueueFull, InvalidRequest):
            for crid in submitted:
                core.abort(crid)
            raise
        self.requests[rid] = req
        for i, crid in enumerate(req.core_rids):
            self._sequences[crid] = (req, i)
        return req

    def route(self, outputs: list[RequestOutput]) -> list[tuple[OpenRequest, RequestOutput]]:
        """The core's outputs as the requests' (rid and index of the request, its counters); those
        of sequences no longer open are dropped. A request whose sequences all ended is closed."""
        routed = []
        for out in outputs:
            seq = self._sequences.get(out.rid)
            if seq is None:
                continue
            req, index = seq
            if index not in req.open:
                continue
            req.usage.update(index, out)
            routed.append((req, req.usage.request_level(out, rid=req.rid, index=index)))
            if out.finish_reason is FinishReason.ERROR:
                req.open.clear()
            elif out.finished:
                req.open.discard(index)
            if req.done:
                self._close(req)
        return routed

    def core_rids(self, rid: str, index: int | None = None) -> list[str]:
        """The core rids of the request's open sequences (or of sequence `index` if open)."""
        req = self.requests.get(rid)
        if req is None:
            return []
        indices = sorted(req.open) if index is None else [index] if index in req.open else []
        return [req.core_rids[i] for i in indices]

    def end(self, rid: str, index: int | None = None) -> list[str]:
        """Close the request's open sequences (or one) from outside the core's outputs (an abort,
        a stop string found downstream, a failure); returns their core rids for the caller to end."""
        req = self.requests.get(rid)
        if req is None:
            return []
        crids = self.core_rids(rid, index)
        req.open.difference_update(range(len(req.core_rids)) if index is None else (index,))
        if req.done:
            self._close(req)
        return crids

    def _close(self, req: OpenRequest) -> None:
        self.requests.pop(req.rid, None)
        for crid in req.core_rids:
            self._sequences.pop(crid, None)
