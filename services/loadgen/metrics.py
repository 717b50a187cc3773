"""RequestResults of one run → the numbers users compare.

Definitions (docs/bench_tool.md repeats them):
  TTFT   first content event − request sent
  E2E    [DONE] − request sent
  TPOT   (E2E − TTFT) / (output tokens − 1), per request with at least 2 output tokens
  ITL    gaps between consecutive content events of a request, all requests pooled
  throughput  completed requests, output tokens, prompt+output tokens per second of wall time
              (wall time: first arrival until the last request ended)
  goodput     completed requests per second meeting every --slo bound (ttft, tpot, e2e: the
              request's value; itl: every gap of the request)
  prefix hit rate  Σ usage.prompt_tokens_details.cached_tokens / Σ usage.prompt_tokens over the
              completed requests whose server reported cached tokens
  spec acceptance rate  Σ usage.speculative.accepted_tokens / Σ usage.speculative.draft_tokens over
              the completed requests that speculated (radixmesh's extra; None when none did)
Statistics: mean, median, p90, p99, with percentiles linear between closest ranks (numpy's default).
Failed requests count in `failed` and `errors`, never in the latency statistics.
"""
from __future__ import annotations

import math
from collections import Counter

from services.loadgen.client import RequestResult


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (NaN when empty), and the sample count."""
    ms = [1e3 * v for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else math.nan, "median": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99), "n": len(ms)}


def meets_slo(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    checks = {"ttft": lambda: r.ttft is not None and 1e3 * r.ttft <= slo_ms["ttft"],
              "tpot": lambda: r.tpot is None or 1e3 * r.tpot <= slo_ms["tpot"],
              "e2e": lambda: 1e3 * r.e2e <= slo_ms["e2e"],
              "itl": lambda: all(1e3 * g <= slo_ms["itl"] for g in r.itl)}
    return r.ok and all(checks[name]() for name in slo_ms)


def _error_counts(results: list[RequestResult], top: int = 5) -> dict[str, int]:
    return dict(Counter((r.error or "")[:160] for r in results if not r.ok).most_common(top))


def summarize(results: list[RequestResult], wall_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    wall = wall_s if wall_s > 0 else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.expected_input_len for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    drafted = sum(r.spec_draft_tokens or 0 for r in ok)
    summary = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": _error_counts(results), "wall_s": wall_s,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "mean_concurrency": sum(r.e2e for r in ok) / wall,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "usage_reported": sum(r.usage_reported for r in ok),
        "prefix_hit_rate": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                            if reported else None),
        "spec_acceptance_rate": sum(r.spec_accepted_tokens or 0 for r in ok) / drafted if drafted else None,
        "slo_ms": dict(slo_ms or {}), "goodput": None, "good_fraction": None,
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in results)
        summary["goodput"] = good / wall
        summary["good_fraction"] = good / len(results) if results else math.nan
    return summary


def merge_runs(parts: list[tuple[list[RequestResult], float]], slo_ms: dict[str, float] | None) -> dict:
    """One summary over several runs made one after another (compare rounds): their results
    pooled, their wall times added."""
    return summarize([r for res, _ in parts for r in res], sum(w for _, w in parts), slo_ms)


def output_timeline(results: list[RequestResult], t0: float, bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start in s, output tokens/s) for plotting; a request's tokens are spread evenly
    over its content events."""
    bins: dict[int, float] = {}
    for r in results:
        if not r.ok or not r.events:
            continue
        per_event = r.output_tokens / len(r.events)
        for t in r.events:
            k = int((t - t0) // bin_s)
            bins[k] = bins.get(k, 0.0) + per_event
    if not bins:
        return []
    return [(k * bin_s, bins.get(k, 0.0) / bin_s) for k in range(min(bins), max(bins) + 1)]
