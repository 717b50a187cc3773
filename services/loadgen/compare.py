"""The same workload against two servers, A (--base-url) and B (--compare), interleaved.

Interleaving: the conversations are cut into --compare-rounds consecutive slices; slice r runs on
A then B when r is even, on B then A when r is odd (A B B A A B ...), each slice with the same
relative arrival times on both. So only one server is loaded at any moment (on a shared CPU two
servers measured at once would steal each other's cores), both see identical requests in the same
order with the same cache history, and a slow drift of the machine (thermal, other tenants)
falls on both alike. The summary of each server pools its slices and adds their wall times.
"""
from __future__ import annotations

import math

from services.loadgen.datasets import Conversation

# metric path in a summary → True when higher is better
RATIO_METRICS: dict[str, bool] = {
    "request_throughput": True, "output_throughput": True, "total_token_throughput": True,
    "goodput": True, "prefix_hit_rate": True, "spec_acceptance_rate": True,
    **{f"{m}_ms.{s}": False for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p90", "p99")},
}


def metric(summary: dict, path: str) -> float | None:
    value: object = summary
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def ratios(a: dict, b: dict) -> dict[str, dict]:
    """For each metric: {"a", "b", "b_over_a", "better"} with better ∈ "A", "B", "=" or None
    (a value missing or NaN)."""
    out = {}
    for path, higher_better in RATIO_METRICS.items():
        va, vb = metric(a, path), metric(b, path)
        usable = va is not None and vb is not None and not (math.isnan(va) or math.isnan(vb))
        ratio = vb / va if usable and va else None
        better = None
        if usable:
            better = "=" if va == vb else ("B" if (vb > va) == higher_better else "A")
        out[path] = {"a": va, "b": vb, "b_over_a": ratio, "better": better}
    return out


def slices(n: int, rounds: int) -> list[range]:
    """Consecutive, near-equal index ranges covering range(n); never an empty one."""
    rounds = max(1, min(rounds, n))
    bounds = [round(i * n / rounds) for i in range(rounds + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(rounds)]


def schedule(convs: list[Conversation], arrivals: list[float], rounds: int) -> list[tuple[str, list, list]]:
    """The run order: (server "A"/"B", the slice's conversations, their arrivals relative to the
    slice's first)."""
    plan = []
    for r, idx in enumerate(slices(len(convs), rounds)):
        part = [convs[i] for i in idx]
        times = [arrivals[i] - arrivals[idx.start] for i in idx]
        for server in (("A", "B") if r % 2 == 0 else ("B", "A")):
            plan.append((server, part, times))
    return plan
