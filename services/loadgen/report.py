"""The printed table (one run, or two side by side with B/A) and the JSON document."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from services.loadgen.client import RequestResult

SCHEMA = "radixmesh-bench/1"

_ROWS: list[tuple[str, str, str]] = [  # label, summary path, format
    ("completed requests", "completed", "{:.0f}"), ("failed requests", "failed", "{:.0f}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
    ("input tokens", "input_tokens", "{:.0f}"), ("output tokens", "output_tokens", "{:.0f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("total throughput (tok/s)", "total_token_throughput", "{:.1f}"),
    ("mean concurrency", "mean_concurrency", "{:.2f}"),
    *[(f"{m.upper()} {s} (ms)", f"{m}_ms.{s}", "{:.1f}")
      for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p90", "p99")],
    ("goodput (req/s)", "goodput", "{:.3f}"), ("good fraction", "good_fraction", "{:.3f}"),
    ("prefix cache hit rate", "prefix_hit_rate", "{:.3f}"),
    ("spec acceptance rate", "spec_acceptance_rate", "{:.3f}"),
]


def _get(summary: dict, path: str) -> Any:
    for key in path.split("."):
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(columns: list[tuple[str, dict]], ratios: dict | None = None) -> str:
    """Rows of metrics, one column per (name, summary); with `ratios` (compare.ratios) a B/A
    column and which server is better on that metric."""
    head = ["metric"] + [name for name, _ in columns] + (["B/A", "better"] if ratios else [])
    rows = [head]
    for label, path, fmt in _ROWS:
        values = [_get(s, path) for _, s in columns]
        if all(v is None for v in values):
            continue
        row = [label] + [_fmt(v, fmt) for v in values]
        if ratios:
            q = ratios.get(path)
            row += [_fmt(q["b_over_a"], "{:.3f}x") if q else "", (q or {}).get("better") or ""]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    errors = [f"  {name}: {n} x {msg}" for name, s in columns for msg, n in (s.get("errors") or {}).items()]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def request_record(r: RequestResult, t0: float) -> dict:
    return {"conversation": r.conversation, "turn": r.turn, "ok": r.ok, "error": r.error,
            "start_s": r.start - t0, "ttft_ms": None if r.ttft is None else 1e3 * r.ttft,
            "tpot_ms": None if r.tpot is None else 1e3 * r.tpot, "e2e_ms": 1e3 * r.e2e,
            "itl_ms": [1e3 * g for g in r.itl], "prompt_tokens": r.prompt_tokens,
            "expected_input_len": r.expected_input_len, "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens, "usage_reported": r.usage_reported,
            "spec_draft_tokens": r.spec_draft_tokens, "spec_accepted_tokens": r.spec_accepted_tokens}


def clean(value: Any) -> Any:
    """NaN/inf → None so that the document is strict JSON."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def document(config: Any, pool: dict, runs: list[dict], ratios: dict | None = None) -> dict:
    """The --output-file document. `runs`: [{"label", "url", "model", "summary", "requests"}]."""
    return clean({"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "config": dataclasses.asdict(config), "word_pool": pool, "runs": runs, "ratios": ratios})
