"""What a grammar backend does, and the registry of backends (adding one: a file and a line).

A backend checks a constraint without a vocabulary (cheap: the scheduler turns a bad schema
into INVALID_ARGUMENT with the backend's reason), compiles it against the model's vocabulary
(expensive: the worker does it off its step thread and caches the result), and makes matchers:
per-request automata that fill a row of the batch's token bitmask and advance with each token.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol


from services.common.grammar.constraint import Constraint


@dataclass(frozen=True)
class GrammarVocab:
    """The model's vocabulary as a grammar sees it: every id's bytes (b"" for special tokens,
    which never spell text) and the ids that end generation."""
    token_bytes: list[bytes]  # [vocab_size], the logits' width
    stop_token_ids: list[int]


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advance over `token_id`; False (state unchanged) when the grammar forbids it."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of the batch bitmask."""

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (may be empty), without advancing."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""


class GrammarBackend(Protocol):
    name: str

    def check(self, constraint: Constraint) -> None:
        """Raise InvalidRequest with the backend's reason when `constraint` cannot compile."""

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (needs the vocabulary given at construction)."""

    def matcher(self, compiled: Any) -> Matcher: ...

    def new_bitmask(self, rows: int) -> Any:
        """A bitmask for `rows` rows, every token allowed."""

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        """logits [B, V] float: -inf where `rows` of the bitmask forbid a token, in place."""

    def compiled_bytes(self, compiled: Any) -> int: ...


# name -> "module:class"; imported on first use (xgrammar pulls in torch).
BACKENDS = {
    "xgrammar": "services.common.grammar.xgrammar_backend:XGrammarBackend",
}


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, vocab: GrammarVocab | None = None, threads: int = 1) -> GrammarBackend:
    """vocab None: a backend that can only check."""
    return backend_class(name)(vocab, threads)


