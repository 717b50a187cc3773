"""Single-stream inter-token latency through the mesh against the model's own
linear-layers-only step at batch 1, measured in the same run (issue 4's
single-stream target: ITL <= 1.3x that step).

The ceiling is the worker's own matmuls for one decode step (every layer's qkv,
o, gate_up and down, then the LM head) on the GGUF file's Q4_1/Q8_0 blocks as
one C++ call (`DecodeStack.linears_only(1)`, bench/ceilings.py mode
gguf-1call): no attention, norms, sampling, scheduling or transport. The gap
between it and the ITL is the engine's whole overhead.

Rounds interleave everything so that the machine's drift hits all alike: a burst
of ceiling timings (the mesh idle), then one request per mesh (64-token random
prompt of ordinary token ids, 128 tokens, greedy, ignore_eos; the order of the
meshes alternates). With --compare-flags a second mesh runs with those flags
(e.g. "--disable-overlap-schedule") and the table shows both.

    .venv/bin/python bench/single_stream.py [--rounds 12] [--compare-flags "..."] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from mesh_overhead import Mesh, itl_samples, mean, random_prompts  # noqa: E402

from services.loadgen.metrics import percentile  # noqa: E402

TARGET = 1.3  # ITL / linear-only step


def report(ceiling_s: list[float], itl_s: dict[str, list[float]]) -> dict:
    """Ceiling timings and pooled ITL gaps per system (seconds) → the numbers and ratios (ms).
    `vs_best`: ITL mean over the fastest ceiling call (the strict reading); `vs_median`: the
    medians of both."""
    best, med = min(ceiling_s), percentile(ceiling_s, 50)
    out = {"ceiling_ms": {"best": 1e3 * best, "median": 1e3 * med, "calls": len(ceiling_s)}, "systems": {}}
    for name, gaps in itl_s.items():
        m, p50 = mean(gaps), percentile(gaps, 50)
        out["systems"][name] = {"itl_mean_ms": 1e3 * m, "itl_median_ms": 1e3 * p50,
                                "itl_p90_ms": 1e3 * percentile(gaps, 90), "samples": len(gaps),
                                "vs_best": m / best, "vs_median": p50 / med}
    return out


def format_report(r: dict) -> str:
    c = r["ceiling_ms"]
    lines = [f"linear-only step, batch 1 (one C++ call): best {c['best']:.2f} ms, median {c['median']:.2f} ms "
             f"({c['calls']} calls)", "",
             f"{'system':<34}{'ITL mean':>10}{'p50':>9}{'p90':>9}{'mean/best':>11}{'p50/p50':>9}"]
    for name, s in r["systems"].items():
        lines.append(f"{name:<34}{s['itl_mean_ms']:>8.2f}ms{s['itl_median_ms']:>7.2f}ms{s['itl_p90_ms']:>7.2f}ms"
                     f"{s['vs_best']:>10.3f}x{s['vs_median']:>8.3f}x")
    lines.append("")
    for name, s in r["systems"].items():
        verdict = "meets" if s["vs_best"] <= TARGET else "misses"
        lines.append(f"{name}: ITL mean is {s['vs_best']:.2f}x the fastest linear-only step ({verdict} <= {TARGET}x)")
    return "\n".join(lines)


def load_ceiling():
    """The worker's model on the file's blocks, for DecodeStack.linears_only."""
    import torch

    from ceilings import GGUFLinearOnly
    from services.common.model_path import default_model_path
    from services.worker.loader.checkpoint import load_checkpoint
    model = GGUFLinearOnly(load_checkpoint(default_model_path()), torch.float32, max_rows=2)
    if model.stack is None:
        raise SystemExit("the decode-stack kernel is not built: python -m kernels.build_all")
    return model.stack


async def measure(args, meshes: dict[str, Mesh], stack) -> dict:
    rng = random.Random(args.seed)
    ceiling: list[float] = []
    gaps: dict[str, list[float]] = {name: [] for name in meshes}
    for mesh in meshes.values():
        await mesh.start_session()
    try:
        for mesh in meshes.values():  # warm: first steps, connections
            await mesh.one(random_prompts(1, args.input_len, rng)[0], 8)
        for r in range(args.rounds):
            for _ in range(3):
                stack.linears_only(1)
            for _ in range(args.ceiling_calls):
                t0 = time.perf_counter()
                stack.linears_only(1)
                ceiling.append(time.perf_counter() - t0)
            time.sleep(0.2)  # this process's kernel threads spin a while after a burst: let them rest
            prompt = random_prompts(1, args.input_len, rng)[0]
            order = list(meshes.items()) if r % 2 == 0 else list(meshes.items())[::-1]
            for name, mesh in order:
                rec = await mesh.one(prompt, args.output_len)
                if rec.tokens != args.output_len:
                    raise RuntimeError(f"{name}: {rec.tokens} tokens, not {args.output_len}")
                gaps[name] += itl_samples(rec.events)
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    finally:
        for mesh in meshes.values():
            await mesh.close_session()
    return report(ceiling, gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--ceiling-calls", type=int, default=20, help="linear-only steps timed per round")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare-flags", default=None, help="a second mesh with these extra `radixmesh up` flags")
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-requests", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    import torch

    print("loading the linear-only ceiling ...", flush=True)
    stack = load_ceiling()
    variants = {"radixmesh up": []}
    if args.compare_flags:
        variants[f"radixmesh up {args.compare_flags}"] = shlex.split(args.compare_flags)
    meshes: dict[str, Mesh] = {}
    try:
        for name, flags in variants.items():
            print(f"starting {name} ...", flush=True)
            meshes[name] = Mesh(args, flags)
        result = asyncio.run(measure(args, meshes, stack))
    finally:
        codes = {name: mesh.close() for name, mesh in meshes.items()}
    print()
    print(format_report(result))
    if args.json:
        info = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores", "torch_threads": torch.get_num_threads(), "args": vars(args),
                "mesh_exit": codes}
        with open(args.json, "w") as f:
            json.dump({**info, **result}, f, indent=2)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
