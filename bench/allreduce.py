#!/usr/bin/env python
"""All-reduce on one host: shared memory (services/worker/parallel/shm_allreduce.py) against gloo
over loopback, per call and per decode step of the default model, measured in the same run.

    .venv/bin/python bench/allreduce.py
    .venv/bin/python bench/allreduce.py --worlds 2 --batches 1 --dtypes bfloat16 --json out.json

A decode step of SmolLM2-135M does 2 all-reduces per layer × 30 layers of [batch, 576]: a step
here is those 60 calls back to back with no compute between them (the communicators' own cost).
The tensors are zeros: gloo sums in place, and zeros stay finite call after call (an add takes the
same time whatever the values). Each world runs as that many spawned processes with one torch
thread each (gloo over a loopback port); the times are rank 0's, the median of --steps steps after
--warmup. With more ranks than cores the ranks share cores, as a tensor-parallel group on a small
machine does. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.worker.parallel.communicator import Communicator, DistCommunicator, init_group, leave_group  # noqa: E402
from services.worker.parallel.shm_allreduce import ShmCommunicator  # noqa: E402

HIDDEN = 576  # SmolLM2-135M
CALLS_PER_STEP = 2 * 30  # attention's and the MLP's output projections, 30 layers
DIST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Row:
    world: int
    dtype: str
    batch: int
    gloo_us_per_call: float
    shm_us_per_call: float

    @property
    def ratio(self) -> float:
        """gloo / shm: how many times faster shared memory is."""
        return self.gloo_us_per_call / self.shm_us_per_call


def step_times(comm: Communicator, x: torch.Tensor, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps' worth of all-reduces of x (collective)."""
    for _ in range(warmup * CALLS_PER_STEP):
        comm.all_reduce(x)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(CALLS_PER_STEP):
            comm.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return times


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    """One rank: every (dtype, batch) with gloo then shm; rank 0 puts the rows on `out`."""
    torch.set_num_threads(1)
    init_group(f"tcp://127.0.0.1:{port}", rank, world, DIST_TIMEOUT_S)
    try:
        gloo = DistCommunicator()
        shm = ShmCommunicator(f"bench-{os.getppid()}-w{world}", fallback=gloo)
        rows = []
        for dtype in args.dtypes:
            for batch in args.batches:
                x = torch.zeros(batch, HIDDEN, dtype=getattr(torch, dtype))  # [batch, hidden]; gloo sums in place
                us = {}
                for name, comm in (("gloo", gloo), ("shm", shm)):
                    torch.distributed.barrier()
                    us[name] = statistics.median(step_times(comm, x, args.warmup, args.steps)) / CALLS_PER_STEP * 1e6
                rows.append(Row(world, dtype, batch, us["gloo"], us["shm"]))
        shm.close()
        if rank == 0:
            out.put(rows)
    finally:
        leave_group()


def run_world(world: int, args: argparse.Namespace) -> list[Row]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=args.timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def print_table(rows: list[Row]) -> None:
    print(f"{'world':>5} {'dtype':>8} {'batch':>5} | {'gloo us/call':>12} {'shm us/call':>11} | "
          f"{'gloo ms/step':>12} {'shm ms/step':>11} | {'gloo/shm':>8}")
    for r in rows:
        print(f"{r.world:>5} {r.dtype:>8} {r.batch:>5} | {r.gloo_us_per_call:>12.1f} {r.shm_us_per_call:>11.1f} | "
              f"{r.gloo_us_per_call * CALLS_PER_STEP / 1e3:>12.2f} {r.shm_us_per_call * CALLS_PER_STEP / 1e3:>11.2f} | "
              f"{r.ratio:>7.1f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    p.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="for one world's whole run")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    print(f"[batch, {HIDDEN}] all-reduces, {CALLS_PER_STEP} per decode step; {os.cpu_count()} cores, "
          f"1 torch thread per rank; median of {args.steps} steps, rank 0's clock")
    rows = [row for world in args.worlds for row in run_world(world, args)]
    print_table(rows)
    if args.json:
        payload = {"cores": os.cpu_count(), "hidden": HIDDEN, "calls_per_step": CALLS_PER_STEP, "steps": args.steps,
                   "rows": [asdict(r) | {"gloo_over_shm": r.ratio} for r in rows]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
