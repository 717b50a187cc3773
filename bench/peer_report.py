"""What one bench/peers.py run reports: the table of every system's numbers with radixmesh /
peer ratios, issue 22's must-show ratios (against peers and against the machine's limits measured
in the same run, bench/ceilings.py machine_limits), and the CPU record the numbers belong to.

Pure functions over the run's results ({system: {workload: loadgen summary}}): tested by
tests/unit/test_peers.py and tests/unit/test_bench_peer_report.py.
"""
from __future__ import annotations

from dataclasses import dataclass

SYSTEMS = ("radixmesh", "llama-server", "vllm", "hf")
PEERS = SYSTEMS[1:]
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


# --- the table ----------------------------------------------------------------------------

# (workload, label, metric path, format, target as text: radixmesh / peer)
ROWS = [
    ("single", "ITL p50 (ms)", "itl_ms.median", "{:.1f}", "<= 0.8x llama-server"),
    ("single", "ITL mean (ms)", "itl_ms.mean", "{:.1f}", ""),
    ("single", "TPOT mean (ms)", "tpot_ms.mean", "{:.1f}", ""),
    ("single", "output tok/s", "output_throughput", "{:.1f}", ""),
    ("throughput", "output tok/s", "output_throughput", "{:.1f}", ">= 2x vllm, >= 6x llama-server"),
    ("throughput", "TTFT p99 (ms)", "ttft_ms.p99", "{:.0f}", ""),
    ("shared-prefix", "e2e mean (ms)", "e2e_ms.mean", "{:.0f}", "<= 0.5x vllm"),
    ("shared-prefix", "TTFT mean (ms)", "ttft_ms.mean", "{:.0f}", ""),
    ("shared-prefix", "TTFT p99 (ms)", "ttft_ms.p99", "{:.0f}", ""),
    ("shared-prefix", "prefix hit rate", "prefix_hit_rate", "{:.3f}", "radixmesh >= 0.85"),
]


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table_rows(results: dict) -> list[dict]:
    """One row per ROWS entry present: each system's value and radixmesh / peer ratios."""
    rows = []
    for wname, label, path, fmt, target in ROWS:
        values = {s: metric(results.get(s, {}).get(wname, {}), path) for s in SYSTEMS}
        if all(v is None for v in values.values()):
            continue
        ours = values["radixmesh"]
        q = {f"radixmesh/{s}": (ours / values[s] if ours is not None and values[s] else None) for s in PEERS}
        rows.append({"workload": wname, "metric": label, "format": fmt, "target": target, **values, **q})
    return rows


def format_table(rows: list[dict]) -> str:
    ratios = [f"radixmesh/{s}" for s in PEERS]
    head = ["workload", "metric", *SYSTEMS, *ratios, "target"]
    lines = [head] + [[r["workload"], r["metric"], *(_cell(r[s], r["format"]) for s in SYSTEMS),
                       *(_cell(r[q], "{:.2f}x") for q in ratios), r["target"]] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(widths[i]) if i in (0, 1, len(head) - 1) else c.rjust(widths[i])
                      for i, c in enumerate(line)).rstrip() for line in lines]
    text.insert(1, "-" * max(len(t) for t in text))
    return "\n".join(text)


# --- issue 22's must-show ratios ----------------------------------------------------------

@dataclass(frozen=True)
class Ratio:
    """radixmesh's `metric` in `workload` over `peer`'s (or over a limit), and the bound it must meet."""
    label: str
    workload: str
    metric: str            # a loadgen summary path, e.g. "itl_ms.median"
    peer: str              # a system name, or "limit:<key>" for a machine limit
    bound: float | None    # None: reported without a target
    at_most: bool          # True: ratio <= bound passes; False: ratio >= bound passes


MUST_SHOW = (
    Ratio("single-stream ITL p50 / llama-server", "single", "itl_ms.median", "llama-server", 0.8, True),
    Ratio("64-concurrent tok/s / vLLM", "throughput", "output_throughput", "vllm", 2.0, False),
    Ratio("64-concurrent tok/s / llama-server", "throughput", "output_throughput", "llama-server", 6.0, False),
    Ratio("shared-prefix e2e mean / vLLM", "shared-prefix", "e2e_ms.mean", "vllm", 0.5, True),
    Ratio("64-concurrent tok/s / bf16 linear-only tok/s at batch 64", "throughput", "output_throughput",
          "limit:linear_tok_s", 0.6, False),
    Ratio("single-stream ITL p50 / batch-1 weight-read floor (issue 41)", "single", "itl_ms.median",
          "limit:batch1_floor_ms", 1.4, True),
)


def metric(summary: dict | None, path: str):
    """summary["a"]["b"] for path "a.b"; None where any part is missing."""
    for key in path.split("."):
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def limit_values(limits: dict | None) -> dict[str, float | None]:
    """The limits a Ratio may name (limit:<key>) from bench/ceilings.py machine_limits()."""
    limits = limits or {}
    return {"linear_tok_s": metric(limits, "linear_only.tok_s"), "batch1_floor_ms": limits.get("batch1_floor_ms")}


def ratio_value(r: Ratio, results: dict, limits: dict | None) -> float | None:
    """The ratio, or None when either side is missing: ours / theirs, and ours / the limit (a
    throughput's fraction of its limit; a latency's multiple of its floor)."""
    ours = metric(results.get("radixmesh", {}).get(r.workload), r.metric)
    if r.peer.startswith("limit:"):
        key = r.peer.removeprefix("limit:")
        limit = limit_values(limits).get(key)
        if not ours or not limit:
            return None
        return ours / limit
    theirs = metric(results.get(r.peer, {}).get(r.workload), r.metric)
    return ours / theirs if ours is not None and theirs else None


def verdict(r: Ratio, value: float | None) -> str:
    if value is None:
        return "n/a"
    if r.bound is None:
        return ""
    ok = value <= r.bound if r.at_most else value >= r.bound
    return "PASS" if ok else "FAIL"


def must_show(results: dict, limits: dict | None) -> list[dict]:
    """One row per MUST_SHOW ratio: its value, target text and verdict."""
    rows = []
    for r in MUST_SHOW:
        v = ratio_value(r, results, limits)
        target = "" if r.bound is None else f"{'<=' if r.at_most else '>='} {r.bound:g}"
        rows.append({"ratio": r.label, "value": v, "target": target, "verdict": verdict(r, v)})
    return rows


def format_must_show(rows: list[dict]) -> str:
    width = max(len(r["ratio"]) for r in rows)
    lines = ["issue 22 and 41 must-show ratios (radixmesh / peer or limit, same run):"]
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.3f}"
        lines.append(f"  {r['ratio'].ljust(width)}  {value:>7}  {r['target']:<7} {r['verdict']}".rstrip())
    return "\n".join(lines)


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo's first processor → its model name, vendor, family/model, and which of
    CPU_FLAGS it lists (AMX listed may still fault in a VM: bench/peer_servers.py)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model_name": fields.get("model name", "unknown"), "vendor": fields.get("vendor_id", "unknown"),
            "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
            "flags": {f: f in flags for f in CPU_FLAGS}}


def cpu_record(path: str = "/proc/cpuinfo") -> dict:
    try:
        with open(path) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {"model_name": "unknown", "flags": {}}
