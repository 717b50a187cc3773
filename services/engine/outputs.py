"""What the Engine hands its callers."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.step.contract import TokenLogprobs


@dataclass
class StreamChunk:
    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class GenerateOutput:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs | None]
    error: str | None = None

    @classmethod
    def from_chunks(cls, chunks: list[StreamChunk]) -> "GenerateOutput":
        last = chunks[-1]
        return cls(last.rid, "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                   last.finish_reason, last.matched_stop, last.prompt_tokens, last.completion_tokens,
                   last.cached_tokens, [lp for c in chunks for lp in c.logprobs], last.error)
