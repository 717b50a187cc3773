"""The one step contract between the scheduler (KV metadata) and the worker (tensors).

The scheduler sends a `StepPlan` per step; the worker answers with a `StepResult`.
A request's full data travels once (`NewRequestSpec`), afterwards only deltas:
the tokens to run and the KV pages appended to its page table. Payloads are
lists of ints and floats, never tensors, so the same dataclasses map 1:1 onto
the worker's protobuf messages (protos/radixmesh/v1/worker.proto; services/step/convert.py
converts both directions). A new field: here, in the proto, and in convert.py
(tests/unit/test_protos.py derives its checks from the dataclasses and the descriptors).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams

# A Step stream's metadata under data-parallel attention: the worker's rank whose plans it carries
# (services/worker/dp_streams.py; the scheduler's --dp-rank).
DP_RANK_METADATA = "x-radixmesh-dp-rank"


@dataclass
class NewRequestSpec:
    """Everything the worker keeps per request, sent on its first step (and again
    after a retraction, when the worker dropped the request's state)."""

    rid: str
    prompt_ids: list[int]  # the original prompt (penalties need it even when cached)
    output_ids: list[int]  # tokens already generated (non-empty after a retraction)
    sampling: SamplingParams
    seed: int  # always set: drawn at admission when the user gave none
    adapter: str = ""  # the LoRA adapter it runs under, by name ("" = the base model)


# A decode item's input when the scheduler planned the step before it learned the
# token (overlapped scheduling): "the token you sampled for this request last".
LAST_SAMPLED = -1


@dataclass
class StepItem:
    """One request's share of a step."""

    rid: str
    input_ids: list[int]  # tokens to run: a prefill chunk, or the last sampled token ([LAST_SAMPLED])
    start_pos: int  # position of input_ids[0] == tokens of this request already in KV
    # Pages appended to the request's page table this step; with reset_pages the
    # table is replaced by these (first step, or after a prefix-cache match).
    new_pages: list[int]
    reset_pages: bool = False
    sample: bool = True  # False for a prefill chunk that is not the prompt's last
    # Jump-forward: input_ids[1:] is a draft, the tokens the request's grammar forces (from the
    # worker's last StepResult.drafts); the worker samples at every position and keeps the
    # longest prefix its own masked sampling agrees with, plus the token after it.
    verify: bool = False
    # Speculation: after sampling, the worker's drafter proposes at most this many tokens
    # (StepResult.drafts, marked speculative); 0: none. The scheduler adapts it to the load.
    draft_depth: int = 0


# KV tiers: the worker's device pool, its host pool, and the shared kvstore.
DEVICE, HOST, STORE = "device", "host", "store"
TIERS = (DEVICE, HOST, STORE)


@dataclass
class KVCopy:
    """Move KV pages between tiers; the worker runs a plan's copies in order,
    before its forward. Pool tiers address pages by index (`src_pages` /
    `dst_pages`); the store by key (`keys`, one per page, when either side is
    STORE). A copy to the store is a write (fire and forget: the worker gathers
    the pages before anything later in the plan can overwrite them); a copy
    from the store loads the longest stored prefix of `keys` into the first
    pages of `dst_pages` and reports how many in its KVTransferStat."""

    src_tier: str
    dst_tier: str
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


@dataclass
class KVTransferStat:
    """What one KVCopy did: pages moved (< asked only for a store load that
    found fewer pages), payload bytes, and the seconds it took on the worker."""

    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class KVSend:
    """PD prefill side: write `src_pages` of this worker's pool into `dst_pages` of the decode
    worker that `descriptor` names (services/worker/kv_transfer). The worker runs a plan's sends
    in order, after its forward, so a send may carry pages that the same step computes."""

    room: str
    descriptor: str
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] = field(default_factory=list)


@dataclass
class KVSendResult:
    """What one KVSend did: the bytes are in place at the receiver unless `error` says why not."""

    room: str
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestSpec] = field(default_factory=list)
    items: list[StepItem] = field(default_factory=list)
    # Requests whose worker-side state (page table row, history) can be dropped.
    released_rids: list[str] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)  # run in order before the forward
    kv_sends: list[KVSend] = field(default_factory=list)  # PD prefill side: run in order after it


@dataclass
class SampledLogprobs:
    logprob: float  # of the sampled token, under the model's raw distribution
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class PromptLogprobs:
    """Logprobs of a run of prompt tokens that one item's rows computed (prompt logprobs: the
    request's sampling.prompt_logprobs): logprobs[i] is prompt[start + i]'s, and its top k are
    (top_token_ids[j], top_logprobs[j]) for j in [i * top_k, (i + 1) * top_k), most likely first."""

    rid: str
    start: int  # prompt position of logprobs[0] (>= 1: the first token has none)
    logprobs: list[float] = field(default_factory=list)
    top_k: int = 0
    top_token_ids: list[int] = field(default_factory=list)  # packed: len(logprobs) * top_k
    top_logprobs: list[float] = field(default_factory=list)

    def top(self, i: int) -> list[tuple[int, float]]:
        k = self.top_k
        return list(zip(self.top_token_ids[i * k:(i + 1) * k], self.top_logprobs[i * k:(i + 1) * k]))


@dataclass
class Embedding:
    """A request's pooled, L2-normalized final hidden state (sampling.embed), once its prompt ran."""

    rid: str
    values: list[float] = field(default_factory=list)  # [hidden]


@dataclass
class TokenRun:
    ids: list[int] = field(default_factory=list)
    speculative: bool = False  # a draft from the speculative drafter, not a grammar's forced tokens


@dataclass
class StepResult:
    """Sampled tokens for the items of the plan that had sample=True, in plan order.

    Jump-forward: `drafts[i]` holds the tokens row i's grammar forces after its last token (the
    scheduler may plan them as a verify item); `accepted[i]`, for a verify item, the tokens
    after next_token_ids[i] that it produced too (each as masked sampling would have picked it).
    Both are parallel to rids, or empty when no row has any."""

    step_id: int
    rids: list[str] = field(default_factory=list)
    next_token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs | None] = field(default_factory=list)
    forward_seconds: float = 0.0
    kv_transfers: list[KVTransferStat] = field(default_factory=list)  # one per plan.kv_copies entry
    accepted: list[TokenRun] = field(default_factory=list)
    drafts: list[TokenRun] = field(default_factory=list)
    draft_seconds: float = 0.0  # speculation: the drafter's time in this step
    kv_sends: list[KVSendResult] = field(default_factory=list)  # one per plan.kv_sends entry
    # Only for requests that ask (sampling.prompt_logprobs, sampling.embed), of any item, sampled or not.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embeddings: list[Embedding] = field(default_factory=list)
