"""Scheduler core outputs and stats ↔ radixmesh.v1 messages (the service's side of the wire).

radixmesh.v1's per-request stream: a sequence's chunk carries the tokens of one
RequestOutput with request-level counters (services/scheduler/open_requests.py); a
finishing output becomes a chunk whose `finish` is set, then the same Finish on its
own, as common.proto specifies. (radixmesh.v2's batches: services/common/outputs_convert.py.)
"""
from __future__ import annotations

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import scheduler_pb2 as spb
from services.common.outputs import RequestOutput, spec_counters
from services.common.outputs_convert import finish_to_proto, logprob_to_proto


def output_events(out: RequestOutput, weights_version: str = "") -> list[cpb.GenerateResponse]:
    """radixmesh.v1's stream events of one request-level output (services/scheduler/open_requests.py):
    a chunk (when it has tokens), then its Finish."""
    events = []
    finish = finish_to_proto(out.index, out.finish_reason, out.matched_stop) if out.finished else None
    if out.token_ids or out.prompt_logprobs or out.embedding:
        chunk = cpb.GenerateChunk(
            index=out.index, token_ids=out.token_ids, logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
            prompt_logprobs=[logprob_to_proto(lp) for lp in out.prompt_logprobs], embedding=out.embedding,
            weights_version=weights_version, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens, **spec_counters(out))
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
