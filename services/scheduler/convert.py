"""Scheduler core outputs and stats ↔ radixmesh.v1 messages (the service's side of the wire).

A sequence's chunk carries the tokens of one RequestOutput; its counters are
request-level (summed over the n sequences, see `Usage`). A finishing output
becomes a chunk whose `finish` is set, then the same Finish on its own, as
common.proto specifies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import scheduler_pb2 as spb
from services.common.outputs import SPEC_COUNTERS, RequestOutput, spec_counters
from services.common.outputs_convert import finish_to_proto, logprob_to_proto


@dataclass
class Usage:
    """Request-level counters over its n sequences: the prompt once, completions and the
    speculative counters summed, cached = the least any sequence reused (the prompt was
    computed at least once)."""
    prompt_tokens: int = 0
    completion: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    spec: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # index -> SPEC_COUNTERS

    def update(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion[index] = out.completion_tokens
        self.cached[index] = out.cached_tokens
        self.spec[index] = tuple(spec_counters(out).values())

    def fill(self, chunk: cpb.GenerateChunk) -> cpb.GenerateChunk:
        chunk.prompt_tokens = self.prompt_tokens
        chunk.completion_tokens = sum(self.completion.values())
        chunk.cached_tokens = min(self.cached.values(), default=0)
        for i, name in enumerate(SPEC_COUNTERS):
            setattr(chunk, name, sum(counts[i] for counts in self.spec.values()))
        return chunk


def output_events(index: int, out: RequestOutput, usage: Usage, weights_version: str = "") -> list[cpb.GenerateResponse]:
    """The stream events of one core output: a chunk (when it has tokens), then its Finish."""
    usage.update(index, out)
    events = []
    finish = finish_to_proto(index, out.finish_reason, out.matched_stop) if out.finished else None
    if out.token_ids:
        chunk = usage.fill(cpb.GenerateChunk(
            index=index, token_ids=out.token_ids, logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
            weights_version=weights_version))
        if finish is not None:
            chunk.finish.CopyFrom(finish)
        events.append(cpb.GenerateResponse(chunk=chunk))
    if finish is not None:
        events.append(cpb.GenerateResponse(finish=finish))
    return events


def stats_proto(core, page_size: int, connected: bool, usage: cpb.Usage) -> spb.SchedulerStats:
    """Counters from the core's stats; KV gauges read live (they may have changed since the last step)."""
    s, kv = core.stats, core.kv
    return spb.SchedulerStats(
        num_running=len(core.running), num_waiting=len(core.waiting),
        kv_pages_used=kv.num_pages - kv.allocator.num_free, kv_pages_total=kv.num_pages,
        kv_pages_cached=kv.cache.cached_pages, page_size=page_size,
        cache_hit_tokens=s.prefix_hit_tokens, cache_query_tokens=s.prefix_query_tokens,
        cache_hits=s.prefix_hits, cache_queries=s.prefix_queries,
        retracted=s.retracted, aborted=s.aborted, finished=s.finished, steps=s.steps,
        worker_connected=connected, total_usage=usage, weights_version=core.limits.weights_version,
        adapters=sorted(core.adapters), resident_adapters=list(core.resident_adapters))


CARRIED_COUNTERS = ("prefix_query_tokens", "prefix_hit_tokens", "prefix_queries", "prefix_hits",
                    "retracted", "aborted", "finished", "steps", "schedule_seconds")


def carry_counters(old, new) -> None:
    """Keep cumulative counters across a rebuilt core (after a worker reconnect)."""
    for name in CARRIED_COUNTERS:
        setattr(new, name, getattr(new, name) + getattr(old, name))
