"""How deep to speculate for a request this step: adaptive to the load and to its acceptance.

A verify item of d drafted tokens makes the step d tokens longer, and drafting them costs the
drafter its time; it yields 1 + E[accepted] tokens, where with a per-token acceptance rate a the
expected accepted prefix of d drafted tokens is a (1 - a^d) / (1 - a). Both costs are the
worker's own, measured (step_costs.py: c(n), the forward of a decode step of n tokens, and the
drafter's seconds per drafted token; before any step is timed, c(n) = 1 + row_cost (n - 1)).
For a request in a step of B rows, the depth that maximizes the step's tokens per second is

    argmax_d (B + E[accepted | d]) / (c(B + d) + draft(d)),   d in 0..max_depth

so speculation deepens for a request whose drafts are accepted, shrinks for one whose are
not, and fades as the batch grows (each extra row costs the whole batch's time); above
`disable_batch_size` running requests it is off. A request's rate is an exponential average of
its verifies' accepted / drafted, starting at the fleet-wide average; while its depth is 0 it
drifts back toward that average, so a request that stopped speculating gets tried again.
Acceptance comes in runs (a quote being copied is accepted whole, then the text moves on): after
s drafts in a row accepted whole, the rate used is at least 1 - 2^-(s+1), so a run deepens at
once instead of waiting for the average to catch up, and the first partial acceptance ends it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.request import Request
from services.scheduler.step_costs import StepCosts

EMA = 0.3  # weight of the newest verify in a request's acceptance rate
RECOVER = 0.05  # per step without a draft, how far the rate drifts back to the fleet's


@dataclass
class SpeculationPolicy:
    max_depth: int  # the worker's drafter's limit (0: no speculation)
    disable_batch_size: int  # no speculation with more running requests than this
    costs: StepCosts  # the worker's measured step and draft costs
    prior: float = 0.6  # the fleet-wide acceptance rate, an exponential average too
    rates: dict[str, float] = field(default_factory=dict)
    streaks: dict[str, int] = field(default_factory=dict)  # drafts in a row accepted whole

    def depth(self, req: Request, batch_size: int) -> int:
        """Tokens the worker may draft for req after this step's sample."""
        if (self.max_depth <= 0 or batch_size > self.disable_batch_size or not req.sampling.speculative
                or req.sampling.logprobs):
            return 0
        base = self.rates.get(req.rid, self.prior)
        streak = self.streaks.get(req.rid, 0)
        rate = max(base, 1 - 0.5 ** (streak + 1)) if streak else base
        costs = self.costs
        best, best_gain = 0, batch_size / costs.step(batch_size)
        for d in range(1, self.max_depth + 1):
            gain = (batch_size + _expected_accepted(rate, d)) / (costs.step(batch_size + d) + costs.draft(d))
            if gain > best_gain * 1.0001:
                best, best_gain = d, gain
        if best == 0:
            self.rates[req.rid] = base + RECOVER * (self.prior - base)
        return best

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify item's outcome: `accepted` of `drafted` tokens."""
        if drafted <= 0:
            return
        observed = accepted / drafted
        rate = self.rates.get(req.rid, self.prior)
        self.rates[req.rid] = rate + EMA * (observed - rate)
        self.prior += 0.05 * (observed - self.prior)
        self.streaks[req.rid] = self.streaks.get(req.rid, 0) + 1 if accepted == drafted else 0

    def forget(self, rid: str) -> None:
        self.rates.pop(rid, None)
        self.streaks.pop(rid, None)


def _expected_accepted(rate: float, depth: int) -> float:
    """E[accepted prefix] of `depth` drafted tokens, each accepted with probability `rate`."""
    if rate >= 1.0:
        return float(depth)
    return rate * (1 - rate ** depth) / (1 - rate)
