#!/usr/bin/env python
"""What tensor parallelism costs on this machine, in one run (issue 34):

1. the all-reduce time per decode step, shared memory against gloo, at the default model's sizes
   ([1, 576] and [64, 576], 60 calls a step) for a group of 3 (bench/allreduce.py's measurement);
2. single-stream ITL and 64-concurrent output throughput of the in-process Engine at TP 1 and
   TP 3 (`--tp-size 3`, the cores split between the ranks: with fewer cores than ranks, one
   thread each), the same greedy requests on both;
3. where a TP 3 decode step's time goes, on the leader: its collectives (all-reduces, the logits'
   all-gather), sending the plan to the followers, and the rest (its share of the compute, and
   waiting for the slowest rank inside the collectives is counted as collective time).

Both Engines use the same flags (--dtype, default bfloat16 where the CPU has it). TP 3 runs on
dense weights (the file's quantized blocks and the one-call decode stack are not sharded yet),
so TP 1 is also reported with --quantization none, the like-for-like baseline. On a 2-core
machine TP cannot be faster; the bench says by how much it is slower and why. Timings are
printed, never asserted.

    .venv/bin/python bench/tensor_parallel.py [--tp 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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


def measure(label: str, worker_flags: dict, args) -> dict:
    from services.engine.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from services.worker.config import WorkerConfig
    worker = WorkerConfig(model=args.model, kv_cache_bytes=512 << 20, max_requests=64, **worker_flags)
    print(f"{label}: loading ...", flush=True)
    engine = Engine(model=args.model, worker=worker, scheduler=SchedulerConfig(max_running_requests=64))
    timed = None
    leader = getattr(engine.runner, "runner", None)  # a group's leader (GroupRunner), else None
    if leader is not None:
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
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(f"CPU: {os.cpu_count()} cores; TP {args.tp} ranks get "
          f"{'one thread each' if os.cpu_count() < args.tp else 'their own cores'}", flush=True)
    results = {"allreduce": allreduce_rows(args.tp)}
    runs = [measure("TP 1", {}, args), measure("TP 1 dense (--quantization none)", {"quantization": "none"}, args),
            measure(f"TP {args.tp}", {"tp_size": args.tp}, args)]
    results["runs"] = runs
    base, dense, tp = runs
    print("\n== single stream and 64 concurrent ==")
    print(f"{'':36} {'ITL mean':>10} {'c=64 tok/s':>11}")
    for r in runs:
        print(f"{r['label']:36} {r['single']['itl_ms']:9.1f}ms {r['throughput']['tok_s']:11.1f}")
    print(f"TP {args.tp} / TP 1 dense: ITL {tp['single']['itl_ms'] / dense['single']['itl_ms']:.2f}x, "
          f"throughput {tp['throughput']['tok_s'] / dense['throughput']['tok_s']:.2f}x")
    print(f"greedy texts equal TP 1 dense: c=1 {tp['single']['texts'] == dense['single']['texts']}, "
          f"c=64 {tp['throughput']['texts'] == dense['throughput']['texts']} (bfloat16 sums differ in order)")
    for key in ("single_breakdown", "throughput_breakdown"):
        b = tp[key]
        print(f"\n== TP {args.tp}, where a step goes on the leader ({key.split('_')[0]}; {b['steps']} steps) ==")
        for name in ("plan_send", "step", "all_reduce", "all_gather", "rest"):
            print(f"  {name:12} {b.get(name, 0.0):8.2f} ms/step")
        print(f"  all-reduces per step: {b['all_reduce_calls_per_step']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
