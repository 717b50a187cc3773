#!/usr/bin/env python
"""What tensor parallelism costs on this machine, in one run (issue 34):

1. the all-reduce time per decode step, shared memory against gloo, at the default model's sizes
   ([1, 576] and [64, 576], 60 calls a step) for a group of 3 (bench/allreduce.py's measurement);
2. single-stream ITL and 64-concurrent output throughput of the in-process Engine at TP 1 and
   TP 3 (`--tp-size 3`, the cores split between the ranks: with fewer cores than ranks, one
   thread each), the same greedy requests on both;
3. where a TP 3 decode step's time goes, on the leader: its collectives (all-reduces, the logits'
   all-gather), sending the plan to the followers, and the rest (its share of the compute, and
   waiting for the slowest rank inside the collectives is counted as collective time);
4. pipeline parallelism: PP 2 (`--pp-size 2`) with micro-batches in flight (`--pp-micro-batches`,
   default one per stage) against the same group with none (`--pp-micro-batches 1`: a step's
   batch crosses the stages whole), same flags and requests, in the same run, alternating
   (--pp-rounds times each, as other work on a shared machine comes and goes), printed as the
   ratio of the medians and of each round.
   A single stream's steps hold one request, so they are never split: its ratio shows the cost
   of the path, the 64-concurrent one the overlap.

Both Engines use the same flags (--dtype, default bfloat16 where the CPU has it): the defaults,
so TP 3's ranks run the file's quantized blocks, cut per rank, and the one-call decode stack, as
TP 1 does; --dense adds TP 1 and TP 3 with --quantization none. On a 2-core
machine TP cannot be faster; the bench says by how much it is slower and why. Timings are
printed, never asserted.

    .venv/bin/python bench/tensor_parallel.py [--tp 3] [--pp 2] [--only tp|pp] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class Timed:
    """Wraps callables on an object, summing their seconds and calls by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


async def run_requests(engine, batch: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    from services.common.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True)
    gaps, tokens, texts = [], 0, []
    sem = asyncio.Semaphore(concurrency)

    async def one(ids):
        nonlocal tokens
        async with sem:
            last, text = None, ""
            async for out in engine.stream(input_ids=ids, sampling=sp):
                if out.error:
                    raise RuntimeError(out.error)
                now = time.perf_counter()
                if out.token_ids:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                text += out.text
                tokens = tokens + len(out.token_ids)
            texts.append(text)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in batch))
    wall = time.perf_counter() - t0
    return {"itl_ms": 1e3 * sum(gaps) / max(1, len(gaps)), "tok_s": tokens / wall, "tokens": tokens,
            "wall_s": wall, "texts": sorted(texts)}


def measure(label: str, worker_flags: dict, args, timings: bool = True) -> dict:
    from services.engine.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from services.worker.config import WorkerConfig
    worker = WorkerConfig(model=args.model, kv_cache_bytes=512 << 20, max_requests=64, **worker_flags)
    print(f"{label}: loading ...", flush=True)
    engine = Engine(model=args.model, worker=worker, scheduler=SchedulerConfig(max_running_requests=64))
    timed = None
    leader = getattr(engine.runner, "runner", None)  # a group's leader (GroupRunner), else None
    if leader is not None and timings:
        timed = Timed()
        timed.wrap(leader.comm, "all_reduce", "all_reduce")
        timed.wrap(leader.comm, "all_gather", "all_gather")
        timed.wrap(engine.runner.group, "send", "plan_send")
        timed.wrap(leader, "execute", "step")
    vocab = engine.runner.model_config.vocab_size
    try:
        out = {"label": label, "flags": worker_flags}
        asyncio.run(run_requests(engine, prompts(2, 16, vocab, 99), 4, 2))  # warm-up
        if timed:
            timed.reset()
        out["single"] = asyncio.run(run_requests(engine, prompts(args.c1_requests, args.input_len, vocab, 1),
                                                 args.c1_tokens, 1))
        if timed:
            out["single_breakdown"] = breakdown(timed)
            timed.reset()
        out["throughput"] = asyncio.run(run_requests(engine, prompts(64, args.input_len, vocab, 2),
                                                     args.tp_tokens, 64))
        if timed:
            out["throughput_breakdown"] = breakdown(timed)
        stage = getattr(getattr(leader, "model", None), "pipeline", None)  # the leader's pipeline stage
        if stage is not None:
            out["pp_steps"], out["pp_micro_batches"] = stage.steps, stage.micro_batches
        print(f"{label}: c=1 ITL {out['single']['itl_ms']:.1f} ms, c=64 {out['throughput']['tok_s']:.1f} tok/s",
              flush=True)
        return out
    finally:
        engine.shutdown()


def breakdown(timed: Timed) -> dict:
    """Per step (ms) on the leader: the step (its forward and sampling) and within it the
    collectives and the rest; the plan's send to the followers comes before the step."""
    steps = max(1, timed.calls["step"])
    per = {k: 1e3 * v / steps for k, v in timed.seconds.items()}
    per["rest"] = per.get("step", 0.0) - per.get("all_reduce", 0.0) - per.get("all_gather", 0.0)
    per["all_reduce_calls_per_step"] = timed.calls["all_reduce"] / steps
    per["steps"] = steps
    return per


def allreduce_rows(tp: int) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, str(REPO / "bench" / "allreduce.py"), "--worlds", str(tp), "--dtypes",
                        "float32", "bfloat16", "--json", f.name], check=True, cwd=REPO)
        return json.load(open(f.name))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--c1-requests", type=int, default=3)
    p.add_argument("--c1-tokens", type=int, default=32)
    p.add_argument("--tp-tokens", type=int, default=16, help="output tokens of each of the 64 concurrent requests")
    p.add_argument("--pp", type=int, default=2, help="the pipeline rows' stages")
    p.add_argument("--pp-micro-batches", type=int, default=None, help="the pipeline row's micro-batches "
                   "(default: one per stage)")
    p.add_argument("--pp-rounds", type=int, default=2, help="each pipeline configuration this many times, alternating")
    p.add_argument("--dense", action="store_true", help="also TP 1 and TP N with --quantization none")
    p.add_argument("--only", choices=("tp", "pp"), default=None, help="only the TP part (1-3) or the PP part (4)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {}
    if args.only != "pp":
        tensor_parallel(args, results)
    if args.only != "tp":
        pipeline_parallel(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def pipeline_parallel(args, results: dict) -> None:
    """PP with micro-batches in flight against PP without, the same group otherwise."""
    print(f"CPU: {os.cpu_count()} cores; PP {args.pp} stages get "
          f"{'one thread each' if os.cpu_count() < args.pp else 'their own cores'}", flush=True)
    k = args.pp_micro_batches or args.pp
    configs = [(f"PP {args.pp}, {k} micro-batches", {"pp_size": args.pp, "pp_micro_batches": k}),
               (f"PP {args.pp}, none (--pp-micro-batches 1)", {"pp_size": args.pp, "pp_micro_batches": 1})]
    rounds = [[measure(label, flags, args, False) for label, flags in configs] for _ in range(args.pp_rounds)]
    results["pipeline"] = rounds
    median = statistics.median
    print("\n== pipeline: single stream and 64 concurrent, each round ==")
    print(f"{'':44} {'ITL mean':>10} {'c=64 tok/s':>11} {'micro-batches/step':>19}")
    for i, runs in enumerate(rounds):
        for r in runs:
            print(f"{'round ' + str(i + 1) + ': ' + r['label']:44} {r['single']['itl_ms']:9.1f}ms "
                  f"{r['throughput']['tok_s']:11.1f} {r['pp_micro_batches'] / max(1, r['pp_steps']):19.2f}")
    itl = [median(runs[j]['single']['itl_ms'] for runs in rounds) for j in (0, 1)]
    tok = [median(runs[j]['throughput']['tok_s'] for runs in rounds) for j in (0, 1)]
    print(f"medians: ITL {itl[0]:.1f} vs {itl[1]:.1f} ms, c=64 {tok[0]:.1f} vs {tok[1]:.1f} tok/s")
    each = ", ".join(f"{m['throughput']['tok_s'] / w['throughput']['tok_s']:.2f}x" for m, w in rounds)
    print(f"micro-batches / none: ITL {itl[0] / itl[1]:.2f}x, c=64 throughput {tok[0] / tok[1]:.2f}x "
          f"(each round: {each})")
    print(f"greedy texts equal: c=1 {all(m['single']['texts'] == w['single']['texts'] for m, w in rounds)}, "
          f"c=64 {all(m['throughput']['texts'] == w['throughput']['texts'] for m, w in rounds)} "
          "(bfloat16 GEMMs of other row counts may round otherwise)")


def tensor_parallel(args, results: dict) -> None:
    print(f"CPU: {os.cpu_count()} cores; TP {args.tp} ranks get "
          f"{'one thread each' if os.cpu_count() < args.tp else 'their own cores'}", flush=True)
    results["allreduce"] = allreduce_rows(args.tp)
    runs = [measure("TP 1", {}, args), measure(f"TP {args.tp}", {"tp_size": args.tp}, args)]
    if args.dense:
        runs += [measure("TP 1 dense (--quantization none)", {"quantization": "none"}, args),
                 measure(f"TP {args.tp} dense", {"tp_size": args.tp, "quantization": "none"}, args)]
    results["runs"] = runs
    print("\n== single stream and 64 concurrent ==")
    print(f"{'':36} {'ITL mean':>10} {'c=64 tok/s':>11}")
    for r in runs:
        print(f"{r['label']:36} {r['single']['itl_ms']:9.1f}ms {r['throughput']['tok_s']:11.1f}")
    for base, tp in zip(runs[::2], runs[1::2]):
        print(f"{tp['label']} / {base['label']}: ITL {tp['single']['itl_ms'] / base['single']['itl_ms']:.2f}x, "
              f"throughput {tp['throughput']['tok_s'] / base['throughput']['tok_s']:.2f}x; greedy texts equal: "
              f"c=1 {tp['single']['texts'] == base['single']['texts']}, "
              f"c=64 {tp['throughput']['texts'] == base['throughput']['texts']} (bfloat16 sums differ in order)")
    tp = runs[1]
    for key in ("single_breakdown", "throughput_breakdown"):
        b = tp[key]
        print(f"\n== TP {args.tp}, where a step goes on the leader ({key.split('_')[0]}; {b['steps']} steps) ==")
        for name in ("plan_send", "step", "all_reduce", "all_gather", "rest"):
            print(f"  {name:12} {b.get(name, 0.0):8.2f} ms/step")
        print(f"  all-reduces per step: {b['all_reduce_calls_per_step']:.1f}")


if __name__ == "__main__":
    sys.exit(main())
