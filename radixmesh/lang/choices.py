"""How select picks a choice from its tokens' logprobs given the prompt.

Each method gets, per choice, the logprobs of the choice's own tokens (after token healing:
state.py) and, when it asks for them, the same tokens' logprobs with no prompt at all; it
returns the index chosen and a score per choice (higher is better)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Method:
    name: str
    pick: Callable[[list[list[float]], list[list[float]] | None], list[float]]
    needs_unconditional: bool = False

    def __call__(self, conditional: list[list[float]], unconditional: list[list[float]] | None = None
                 ) -> tuple[int, list[float]]:
        scores = self.pick(conditional, unconditional)
        return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else -math.inf


def _normalized(cond, _unc) -> list[float]:
    return [_mean(lps) for lps in cond]


def _greedy(cond, _unc) -> list[float]:
    """The choice a greedy decoder would follow furthest: compare token by token (first tokens
    first, a choice that ran out loses to one that goes on), scored by rank."""
    longest = max(len(lps) for lps in cond)
    keys = [tuple(lps) + (-math.inf,) * (longest - len(lps)) for lps in cond]
    order = sorted(range(len(cond)), key=lambda i: keys[i])
    scores = [0.0] * len(cond)
    for rank, i in enumerate(order):
        scores[i] = float(rank)
    return scores


def _unconditional(cond, unc) -> list[float]:
    """Mean of how much the prompt raised each token's logprob; a token with no unconditional
    logprob (a choice's first) is left out, and a one-token choice falls back to its logprob."""
    out = []
    for lps, ulps in zip(cond, unc or [[None] * len(cond)]):
        gains = [c - u for c, u in zip(lps, ulps) if u is not None]
        out.append(_mean(gains) if gains else _mean(lps))
    return out


token_length_normalized = Method("token_length_normalized", _normalized)
greedy_token_selection = Method("greedy_token_selection", _greedy)
unconditional_likelihood_normalized = Method("unconditional_likelihood_normalized", _unconditional,
                                             needs_unconditional=True)
