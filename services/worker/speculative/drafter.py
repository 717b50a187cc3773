"""What a drafter does, and the registry of drafters (adding one: a file, a line here and its
name in services/worker/config.py's SPECULATIVE_ALGORITHMS, which the flag is checked against).

Speculative decoding (seed §4.9): a drafter proposes the next few tokens of a request cheaply;
the target model checks them all in one forward (a verify item: services/worker/jump_forward.py
keeps the longest prefix its own sampling agrees with, plus its token after it). Drafts are
deterministic (a lookup, or a draft model's argmax). For a deterministic draft the exact
rejection-sampling rule accepts token x with probability min(1, p(x) / 1) = p(x), which is the
probability that the target's own sample at that position is x: the verify item draws that very
sample (counter-based noise keyed by the seed and the position, services/worker/sampling.py),
so the output is token for token what plain decoding draws with the same seed, and its
distribution is plain sampling's.

A drafter keeps per-request state, told of every token a request gains (prompt at admission,
then each accepted run), and proposes for a batch of requests at once (a draft model runs its
steps batched). EAGLE-style drafters read the target's hidden states: the runner hands them each
request's captured rows through `observe` (a drafter with that method; speculative/eagle.py), and
their proposals may be trees (speculative/tree.py's DraftTree), verified under a tree mask.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class DraftRequest:
    """One request to draft for, and how many tokens to propose at most (the drafter knows its
    tokens from admit/extend)."""
    rid: str
    depth: int


class Drafter(Protocol):
    def admit(self, rid: str, tokens: list[int]) -> None:
        """A request's tokens so far (admission, or re-admission after a retraction)."""

    def extend(self, rid: str, tokens: list[int]) -> None:
        """Tokens the request just gained (accepted by the target)."""

    def propose(self, batch: list[DraftRequest], hidden: Any = None) -> list[list[int]]:
        """For each request, at most `depth` tokens likely to follow its tokens (may be empty)."""

    def release(self, rid: str) -> None:
        """Forget the request (finished, aborted, retracted)."""


# --speculative-algorithm name (config.SPECULATIVE_ALGORITHMS) -> "module:factory"; the factory
# takes (WorkerConfig, the target's runner).
_DRAFTERS: dict[str, str] = {
    "NGRAM": "services.worker.speculative.ngram:NgramDrafter.from_config",
    "STANDALONE": "services.worker.speculative.draft_model:DraftModelDrafter.from_config",
    "EAGLE": "services.worker.speculative.eagle:EagleDrafter.from_config",
    "EAGLE3": "services.worker.speculative.eagle:EagleDrafter.from_config",
    "NEXTN": "services.worker.speculative.eagle:EagleDrafter.from_config",
}


def algorithms() -> list[str]:
    return sorted(_DRAFTERS)


def create_drafter(name: str, config: Any, runner: Any) -> Drafter:
    if name not in _DRAFTERS:
        raise ValueError(f"unknown --speculative-algorithm {name!r}; choose from {algorithms()}")
    module, attr = _DRAFTERS[name].split(":")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target(config, runner)
