"""StepPlan / StepResult dataclasses ↔ radixmesh.v1 worker messages.

Field-by-field, lossless copies (services/step/contract.py is the source of
truth; the proto mirrors it). The one place each direction is converted: the
scheduler service encodes plans and decodes results, the worker the reverse.
These run once per step on both ends, so they build messages through
constructor keyword arguments (one call into the protobuf runtime per message)
instead of per-field assignment.

Encoding notes:
- `StepItem.sample` is `optional bool`: written only when False, unset reads
  as True, so the common decode item costs nothing for it.
- `StepResult.logprobs` entries may be None; each travels in a `LogprobSlot`
  whose `value` is unset for None. `top` pairs travel as two packed arrays.
"""
from __future__ import annotations

from protos.radixmesh.v1 import worker_pb2 as pb
from services.common.convert import sampling_from_proto, sampling_to_proto
from services.step.contract import (
    Embedding,
    PromptLogprobs,
    KVCopy,
    KVSend,
    KVSendResult,
    KVTransferStat,
    NewRequestSpec,
    StepItem,
    StepPlan,
    StepResult,
    TokenRun,
    SampledLogprobs,
)


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            pb.NewRequestSpec(
                rid=r.rid,
                prompt_ids=r.prompt_ids,
                output_ids=r.output_ids,
                sampling=sampling_to_proto(r.sampling),
                seed=r.seed,
                adapter=r.adapter,
            )
            for r in plan.new_requests
        ],
        items=[
            pb.StepItem(
                rid=it.rid,
                input_ids=it.input_ids,
                start_pos=it.start_pos,
                new_pages=it.new_pages,
                reset_pages=it.reset_pages,
                sample=None if it.sample else False,  # None leaves it unset (= True)
                verify=it.verify,
                draft_depth=it.draft_depth,
            )
            for it in plan.items
        ],
        released_rids=plan.released_rids,
        kv_copies=[pb.KVCopy(src_tier=c.src_tier, dst_tier=c.dst_tier, src_pages=c.src_pages,
                             dst_pages=c.dst_pages, keys=c.keys) for c in plan.kv_copies],
        kv_sends=[pb.KVSend(room=k.room, descriptor=k.descriptor, src_pages=k.src_pages, dst_pages=k.dst_pages)
                  for k in plan.kv_sends],
    )


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestSpec(
                rid=r.rid,
                prompt_ids=list(r.prompt_ids),
                output_ids=list(r.output_ids),
                sampling=sampling_from_proto(r.sampling),
                seed=r.seed,
                adapter=r.adapter,
            )
            for r in msg.new_requests
        ],
        items=[
            StepItem(
                rid=it.rid,
                input_ids=list(it.input_ids),
                start_pos=it.start_pos,
                new_pages=list(it.new_pages),
                reset_pages=it.reset_pages,
                sample=it.sample if it.HasField("sample") else True,
                verify=it.verify,
                draft_depth=it.draft_depth,
            )
            for it in msg.items
        ],
        released_rids=list(msg.released_rids),
        kv_copies=[KVCopy(c.src_tier, c.dst_tier, list(c.src_pages), list(c.dst_pages), list(c.keys))
                   for c in msg.kv_copies],
        kv_sends=[KVSend(k.room, k.descriptor, list(k.src_pages), list(k.dst_pages)) for k in msg.kv_sends],
    )


def _logprobs_to_proto(lp: SampledLogprobs | None) -> pb.LogprobSlot:
    if lp is None:
        return pb.LogprobSlot()
    return pb.LogprobSlot(value=pb.SampledLogprobs(
        logprob=lp.logprob,
        top_token_ids=[tok for tok, _ in lp.top],
        top_logprobs=[logprob for _, logprob in lp.top],
    ))


def _logprobs_from_proto(slot: pb.LogprobSlot) -> SampledLogprobs | None:
    if not slot.HasField("value"):
        return None
    v = slot.value
    if len(v.top_token_ids) != len(v.top_logprobs):
        raise ValueError(f"top_token_ids ({len(v.top_token_ids)}) and top_logprobs "
                         f"({len(v.top_logprobs)}) must have the same length")
    return SampledLogprobs(logprob=v.logprob, top=list(zip(v.top_token_ids, v.top_logprobs)))


def result_to_proto(result: StepResult) -> pb.StepResult:
    return pb.StepResult(
        step_id=result.step_id,
        rids=result.rids,
        next_token_ids=result.next_token_ids,
        logprobs=[_logprobs_to_proto(lp) for lp in result.logprobs],
        forward_seconds=result.forward_seconds,
        kv_transfers=[pb.KVTransferStat(pages=t.pages, bytes=t.bytes, seconds=t.seconds)
                      for t in result.kv_transfers],
        accepted=[pb.TokenRun(ids=r.ids, speculative=r.speculative) for r in result.accepted],
        drafts=[pb.TokenRun(ids=r.ids, speculative=r.speculative) for r in result.drafts],
        draft_seconds=result.draft_seconds,
        kv_sends=[pb.KVSendResult(room=k.room, pages=k.pages, bytes=k.bytes, seconds=k.seconds, error=k.error)
                  for k in result.kv_sends],
        prompt_logprobs=[_prompt_logprobs_to_proto(p) for p in result.prompt_logprobs],
        embeddings=[pb.Embedding(rid=e.rid, values=e.values) for e in result.embeddings],
    )


def _prompt_logprobs_to_proto(p: PromptLogprobs) -> pb.PromptLogprobs:
    return pb.PromptLogprobs(rid=p.rid, start=p.start, logprobs=p.logprobs, top_k=p.top_k,
                             top_token_ids=p.top_token_ids, top_logprobs=p.top_logprobs)


def _prompt_logprobs_from_proto(m: pb.PromptLogprobs) -> PromptLogprobs:
    return PromptLogprobs(m.rid, m.start, list(m.logprobs), m.top_k, list(m.top_token_ids), list(m.top_logprobs))


def result_from_proto(msg: pb.StepResult) -> StepResult:
    """Raises ValueError when a logprob entry's parallel top arrays disagree in length."""
    return StepResult(
        step_id=msg.step_id,
        rids=list(msg.rids),
        next_token_ids=list(msg.next_token_ids),
        logprobs=[_logprobs_from_proto(slot) for slot in msg.logprobs],
        forward_seconds=msg.forward_seconds,
        kv_transfers=[KVTransferStat(t.pages, t.bytes, t.seconds) for t in msg.kv_transfers],
        accepted=[TokenRun(list(r.ids), r.speculative) for r in msg.accepted],
        drafts=[TokenRun(list(r.ids), r.speculative) for r in msg.drafts],
        draft_seconds=msg.draft_seconds,
        kv_sends=[KVSendResult(k.room, k.pages, k.bytes, k.seconds, k.error) for k in msg.kv_sends],
        prompt_logprobs=[_prompt_logprobs_from_proto(p) for p in msg.prompt_logprobs],
        embeddings=[Embedding(e.rid, list(e.values)) for e in msg.embeddings],
    )
