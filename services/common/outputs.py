"""What generation hands back, one representation from the scheduler to the gateway.

The scheduler emits a `RequestOutput` per request per step (token ids only); the
in-process Engine fills its `text`; in the mesh the chunk travels as protobuf and the
gateway reads it back into the same type (services/gateway/backend.py), one per sequence `index`. The
worker's packed per-step form of a sampled token's logprobs stays in the step
contract (services/step/contract.SampledLogprobs); everything above it uses
`TokenLogprob`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sequence ended. A str, so it compares, prints and serializes as its value."""

    STOP = "stop"  # a stop token, EOS or a stop string
    LENGTH = "length"  # max_new_tokens or the context
    ABORT = "abort"  # the client went away, or the server is draining
    ERROR = "error"  # the engine failed the request (in-process Engine only; the mesh sends a status)

    def __str__(self) -> str:
        return self.value


@dataclass
class TopToken:
    token_id: int
    logprob: float
    token: str | None = None  # the token's text, once a stage with the vocabulary knows it
    bytes: bytes | None = None  # its UTF-8 bytes (None: those of `token`)


@dataclass
class TokenLogprob:
    """One generated token's logprob under the model's raw distribution, and the most likely tokens."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token (prompt logprobs): it has none
    top: list[TopToken] = field(default_factory=list)  # most likely first
    token: str | None = None
    bytes: bytes | None = None


# Speculative decoding's per-request counters: RequestOutput's, the scheduler's Request's and the
# protos' (GenerateChunk, Usage) field names alike.
SPEC_COUNTERS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


def spec_counters(counted) -> dict[str, int]:
    """The speculative counters of anything carrying them under SPEC_COUNTERS' names."""
    return {name: getattr(counted, name) for name in SPEC_COUNTERS}


@dataclass
class RequestOutput:
    """New tokens of one sequence since its last output; counters are cumulative for the request."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for, else empty
    text: str = ""  # the tokens' text (empty until a stage detokenizes)
    index: int = 0  # the sequence within the request (n > 1)
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # Speculative decoding, cumulative: verify steps, tokens drafted, drafted tokens accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    weights_version: str = ""  # of the weights that computed the tokens (set by the services' streams)
    # A sequence's first output only, when asked (SamplingParams.prompt_logprobs): one per prompt
    # position from logprob_start_len on; and its pooled final hidden state (SamplingParams.embed).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)

    @classmethod
    def joined(cls, outputs: list["RequestOutput"]) -> "RequestOutput":
        """A whole sequence from its stream of outputs: tokens, text and logprobs concatenated,
        the rest from the last."""
        last = outputs[-1]
        return cls(last.rid, [t for o in outputs for t in o.token_ids], [lp for o in outputs for lp in o.logprobs],
                   "".join(o.text for o in outputs), last.index, last.finished, last.finish_reason,
                   last.matched_stop, last.prompt_tokens, last.completion_tokens, last.cached_tokens, last.error,
                   last.spec_verify_steps, last.spec_draft_tokens, last.spec_accepted_tokens,
                   next((o.weights_version for o in reversed(outputs) if o.weights_version), ""),
                   [lp for o in outputs for lp in o.prompt_logprobs], [v for o in outputs for v in o.embedding])
