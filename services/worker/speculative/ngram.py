"""Prompt-lookup drafting: the tokens that followed the last occurrence of the request's latest
n-gram, in its own prompt and output (copying a quote, an edited file, a re-sent history).

Each request keeps an index from every n-gram (n in [min_n, max_n]) to the position just after
its latest occurrence, updated as tokens are accepted: O(max_n) dict updates per token, and a
proposal is at most max_n - min_n + 1 lookups. The longest n-gram that occurred before wins.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.worker.speculative.drafter import DraftRequest


@dataclass
class NgramIndex:
    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # n-gram -> the position after its latest occurrence whose continuation is known
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, new: list[int]) -> None:
        for token in new:
            # Before appending: every n-gram ending at the current last token now has a known
            # continuation (the token being appended), so it enters the index.
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, depth: int) -> list[int]:
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self.follows.get(tuple(self.tokens[end - n:end]))
            if at is not None:
                return self.tokens[at:at + depth]
        return []


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram window must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indices: dict[str, NgramIndex] = {}

    @classmethod
    def from_config(cls, config: Any, runner: Any = None) -> "NgramDrafter":
        return cls(config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size)

    def admit(self, rid: str, tokens: list[int]) -> None:
        index = self.indices[rid] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)

    def extend(self, rid: str, tokens: list[int]) -> None:
        self.indices[rid].extend(tokens)

    def propose(self, batch: list[DraftRequest], hidden: Any = None) -> list[list[int]]:
        return [self.indices[r.rid].propose(r.depth) if r.depth > 0 else [] for r in batch]

    def release(self, rid: str) -> None:
        self.indices.pop(rid, None)
