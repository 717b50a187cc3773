"""Per-request sampling parameters, shared by every stage."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.grammar.constraint import Constraint


class InvalidRequest(ValueError):
    """Bad user input. Transports map it to HTTP 400 / gRPC INVALID_ARGUMENT."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # applied by the detokenizer
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None  # structured output: masked in the worker (services/common/grammar)
    speculative: bool = True  # False: this request never speculates, even when the server does
    # Prompt (input) logprobs: -1 none; k >= 0: the logprob of every prompt token from position
    # logprob_start_len on (the first token has none) with its top k. The scheduler reuses no cached
    # prefix past logprob_start_len - 1: a cached position has no logits.
    prompt_logprobs: int = -1
    logprob_start_len: int = 0
    # Return the prompt's pooled, L2-normalized final hidden state (the worker's --pooling); such a
    # request reuses no cached prefix (mean pooling needs every position's hidden state).
    embed: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest with a message a user can act on."""
        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.max_new_tokens < 0:  # 0: prefill only (the prompt's KV cached, prompt logprobs, embedding)
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if not -1 <= self.prompt_logprobs <= 20:
            raise InvalidRequest(f"prompt_logprobs must be in [0, 20] (or -1: none), got {self.prompt_logprobs}")
        if self.logprob_start_len < 0:
            raise InvalidRequest(f"logprob_start_len must be >= 0, got {self.logprob_start_len}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
