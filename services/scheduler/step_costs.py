"""What the worker's decode steps cost, as they are measured: the speculation policy's prices.

A decode step of n tokens (one per plain row, 1 + draft per verify item) takes c(n) seconds of
the worker's forward, and drafting d tokens takes the drafter about d * per_token seconds more.
Both are read off the worker's own results (StepResult.forward_seconds and draft_seconds), so
the policy prices a verify at what it costs on this machine, with this drafter: on a CPU whose
extra rows are compute-bound (an AVX2-only EPYC, float32 activations: 4 tokens cost 1.7 one-token
steps) or whose drafter is slow, speculation stops, where a fixed guess kept it on and made
single streams slower (docs/benchmarks.md, issue 39).

Until a step of n tokens has been seen, c(n) comes from its measured neighbours (linear through
the nearest two), from the prior's shape scaled to the one size measured, or with nothing
measured from the prior 1 + row_cost (n - 1) in units of c(1) (--speculative-row-cost). A
request that speculates from its first decode never runs a one-token step, so c(1) is often
extrapolated from the verify sizes it did run. Steps that prefill, move KV between tiers or
carry no timing (the model-free test worker) are not observed: only a decode step's time is a
price of tokens.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

WEIGHT = 0.1  # weight of the newest observation in each exponential average


@dataclass
class StepCosts:
    row_cost: float  # the prior: one more token in a step, as a fraction of a one-token step
    seconds: dict[int, float] = field(default_factory=dict)  # tokens in a decode step → its forward's seconds
    draft_base: float | None = None  # the drafter's seconds in a step that drafted nothing (extending)
    draft_per_token: float | None = None  # the drafter's seconds per token drafted, beyond the base
    sizes: list[int] = field(default_factory=list)  # the keys of `seconds`, sorted (step() runs per depth tried)

    def observe_step(self, tokens: int, forward_seconds: float, draft_seconds: float, drafted: int) -> None:
        """A decode step of `tokens` tokens took forward_seconds, draft_seconds of it drafting
        `drafted` tokens (the depths the plan asked for)."""
        if tokens < 1 or forward_seconds <= 0:
            return
        if tokens not in self.seconds:
            bisect.insort(self.sizes, tokens)
        self.seconds[tokens] = _ema(self.seconds.get(tokens), forward_seconds - draft_seconds)
        if drafted <= 0:
            self.draft_base = _ema(self.draft_base, draft_seconds)
        else:
            per_token = max(0.0, draft_seconds - (self.draft_base or 0.0)) / drafted
            self.draft_per_token = _ema(self.draft_per_token, per_token)

    def step(self, tokens: int) -> float:
        """c(tokens): measured, interpolated, or the prior (in units of c(1) when nothing is measured)."""
        known, sizes = self.seconds, self.sizes
        if tokens in known:
            return known[tokens]
        if not known:
            return self._prior(tokens)
        if len(sizes) == 1:  # one measured size: the prior's shape, scaled to it
            return known[sizes[0]] * self._prior(tokens) / self._prior(sizes[0])
        # the two measured sizes around `tokens`, or the two nearest on its side: a line through them
        i = min(max(bisect.bisect_left(sizes, tokens), 1), len(sizes) - 1)
        a, b = sizes[i - 1], sizes[i]
        slope = max(0.0, (known[b] - known[a]) / (b - a))
        return max(known[a] + (tokens - a) * slope, known[sizes[0]] / self._prior(sizes[0]) * 0.1)

    def draft(self, depth: int) -> float:
        """The drafter's extra seconds for drafting `depth` tokens (0 until measured)."""
        return depth * (self.draft_per_token or 0.0) if depth > 0 else 0.0

    def _prior(self, tokens: int) -> float:
        return 1.0 + self.row_cost * (tokens - 1)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
