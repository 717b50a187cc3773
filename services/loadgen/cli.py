"""`radixmesh bench`: run a workload against an OpenAI-compatible server (and optionally a
second one, --compare), print the table, write JSON (--output-file) and a PNG (--plot).

    radixmesh bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 64 \\
        --input-len 256 --output-len 128 --ignore-eos --max-concurrency 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass, field

from services.common.config import parse_config
from services.loadgen.arrivals import arrival_times
from services.loadgen.client import first_model
from services.loadgen.compare import ratios, schedule
from services.loadgen.config import BenchConfig
from services.loadgen.datasets import build_dataset
from services.loadgen.driver import RunOutput, Target, new_session, run_workload, warm_up
from services.loadgen.metrics import merge_runs
from services.loadgen.report import document, format_table, request_record
from services.loadgen.words import WordPool, load_pool


@dataclass
class ServerRuns:
    label: str
    target: Target
    runs: list[RunOutput] = field(default_factory=list)

    def summary(self, slo_ms: dict) -> dict:
        return merge_runs([(r.results, r.wall_s) for r in self.runs], slo_ms)

    def entry(self, slo_ms: dict) -> dict:
        return {"label": self.label, "url": self.target.url, "model": self.target.model,
                "summary": self.summary(slo_ms),
                "requests": [request_record(res, run.t0) for run in self.runs for res in run.results]}


async def _measure(cfg: BenchConfig, pool: WordPool) -> list[ServerRuns]:
    convs = build_dataset(cfg, pool)
    arrivals = arrival_times(len(convs), cfg.request_rate, cfg.seed)
    warm_prompt = pool.text(16, random.Random(cfg.seed + 1))
    async with new_session() as session:
        servers = {"A": ServerRuns("A", Target(cfg.base_url, cfg.model or await first_model(session, cfg.base_url)))}
        if cfg.compare:
            servers["B"] = ServerRuns("B", Target(cfg.compare, cfg.compare_model
                                                  or await first_model(session, cfg.compare)))
        for s in servers.values():
            await warm_up(session, s.target, warm_prompt, cfg.warmup_requests, cfg.timeout_s)
        plan = schedule(convs, arrivals, cfg.compare_rounds) if cfg.compare else [("A", convs, arrivals)]
        for i, (name, part, times) in enumerate(plan):
            label = f"{name} {i + 1}/{len(plan)}" if cfg.compare else name
            servers[name].runs.append(await run_workload(session, servers[name].target, part, times, cfg,
                                                         cfg.extra, label))
    return list(servers.values())


def run_bench(cfg: BenchConfig, pool: WordPool | None = None) -> tuple[dict, list[ServerRuns]]:
    """Measure; write --output-file and --plot when set. Returns (the JSON document, the raw runs).
    Raises RuntimeError when a server cannot be reached at all (its /v1/models)."""
    pool = pool or load_pool(cfg.tokenizer)
    servers = asyncio.run(_measure(cfg, pool))
    entries = [s.entry(cfg.slo_ms) for s in servers]
    q = ratios(entries[0]["summary"], entries[1]["summary"]) if len(entries) == 2 else None
    doc = document(cfg, {"tokenizer": pool.tokenizer_name, "exact": pool.exact, "words": len(pool.words)},
                   entries, q)
    if cfg.output_file:
        with open(cfg.output_file, "w") as f:
            json.dump(doc, f, indent=1)
    if cfg.plot:
        from services.loadgen.plot import write_plot
        write_plot(cfg.plot, [(f"{s.label}: {s.target.url}", s.runs) for s in servers])
    return doc, servers


def table(doc: dict) -> str:
    columns = [(f"{r['label']} ({r['url']})", r["summary"]) for r in doc["runs"]]
    return format_table(columns, doc.get("ratios"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixmesh bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cfg = parse_config(BenchConfig, argv, parser)
    try:
        doc, _ = run_bench(cfg)
    except (RuntimeError, ImportError, FileNotFoundError, ValueError) as e:
        print(f"radixmesh bench: {e}", file=sys.stderr)
        return 1
    print(table(doc))
    if doc.get("ratios"):
        print("B/A: B's value over A's (throughput: > 1 means B is faster; latency: < 1 means B is faster)")
    if cfg.output_file:
        print(f"results: {cfg.output_file}")
    if cfg.plot:
        print(f"plot: {cfg.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
