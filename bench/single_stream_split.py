"""Where one single-stream token's time goes, in process and through the mesh, against the
batch-1 weight-read floor measured in the same run (issue 41: measure first).

1. **The floor.** The step's weight bytes (the checkpoint's quantized blocks: what a batch-1
   step reads) over the read bandwidth measured now (bench/ceilings.py's machine_limits).
2. **In process.** The Engine, at its defaults, streams --requests requests one at a time
   (--input-len random token ids, --output-len tokens, greedy, ignore_eos) with
   bench/phase_timers.py's timers put into this process. Then the worker's linears alone, as the
   one-call step runs them (`DecodeStack.linears_only(1)` on the Engine's own model, its
   activation format included), timed on the Engine's step thread.
3. **Through the mesh.** `radixmesh up` (plus --radixmesh-args) serves the same workload
   (bench/mesh_profile.py's measure: the worker timed the same way, every mesh process's CPU
   read from /proc over the window).

The table, per output token: the linears against the floor; the one-call decode step split by
its own timers (`DecodeStack.phase_seconds`: the linears as the step runs them, attention over
the short KV, RoPE and the KV write, norms/SwiGLU/residuals, the LM head, the step's set-up);
sampling; the runner's Python; the worker's step RPC and its wait between steps (mesh);
then the CPU each mesh process spends per token, each one hop of the token's way out
(scheduler, detokenizer, tokenizer, gateway), against zero. Printed, never asserted.

    .venv/bin/python bench/single_stream_split.py [--requests 12] [--radixmesh-args "..."] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from ceilings import best_of, machine_limits  # noqa: E402
from mesh_overhead import InProcess, itl_samples, random_prompts  # noqa: E402
from mesh_profile import WORKER_PHASES  # noqa: E402
from mesh_profile import measure as measure_mesh  # noqa: E402

from services.loadgen.metrics import percentile  # noqa: E402

# phase keys of bench/phase_timers.py, per decode token
STEP_PHASES = ("one_call", "prefill_matmul", "decode_matmul", "attention", "elementwise", "sampling", "step", "rpc")
HOPS = ("scheduler", "detokenizer", "tokenizer", "gateway", "router", "launcher")


def per_token_ms(seconds: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: 1e3 * seconds.get(k, 0.0) / tokens for k in STEP_PHASES}


def measure_in_process(args) -> dict:
    """The Engine's single stream with phase timers in this process; then its linears alone."""
    import phase_timers

    clock = phase_timers.PhaseClock()
    phase_timers.install(clock)
    engine = InProcess(SimpleNamespace(model=args.model, kv_cache_bytes=None))
    eng = engine.engine
    stack = eng.runner.model.decode_stack  # None: the one-call step is off
    rng = random.Random(args.seed)

    async def run() -> list[float]:
        for ids in random_prompts(2, args.input_len, rng):  # first steps, code paths' caches
            await engine.one(ids, 8)
        if stack is not None:
            stack.reset_phases()
        before = dict(clock.seconds), dict(clock.counters)
        gaps: list[float] = []
        for ids in random_prompts(args.requests, args.input_len, rng):
            rec = await engine.one(ids, args.output_len)
            gaps += itl_samples(rec.events)
        return gaps, before

    try:
        gaps, (sec0, cnt0) = asyncio.run(run())
        tokens = clock.counters["decode_tokens"] - cnt0.get("decode_tokens", 0)
        seconds = {k: v - sec0.get(k, 0.0) for k, v in clock.seconds.items()}
        step_split = None if stack is None else one_call_split(stack.phase_seconds())
        linears = None
        if stack is not None:  # on the step thread, as the worker calls it
            linears = eng._executor.submit(lambda: best_of(lambda: stack.linears_only(1), 30, warmup=3)).result()
        backend = eng.runner.backend
        return {"itl_ms": {"median": 1e3 * percentile(gaps, 50), "mean": 1e3 * sum(gaps) / len(gaps),
                           "n": len(gaps)},
                "phases_ms": per_token_ms(seconds, tokens), "decode_tokens": tokens,
                "linears_only_ms": None if linears is None else 1e3 * linears, "one_call_split_ms": step_split,
                "int8_activations": bool(getattr(backend, "int8_activations", False))}
    finally:
        engine.close()


def one_call_split(phases: dict) -> dict[str, float]:
    """DecodeStack.phase_seconds() → ms per one-call step, by phase."""
    steps = max(1, phases.get("steps", 0))
    return {name: 1e3 * seconds / steps for name, seconds in phases.items() if name != "steps"}


# the one-call step's phases (DecodeStack.phase_seconds), as the table names them
ONE_CALL_PHASES = (("linears", "linears, as the step runs them"), ("lm_head", "LM head"),
                   ("attention", "attention"), ("rope_kv_write", "RoPE + KV write"),
                   ("elementwise", "norms, SwiGLU, residuals, embedding"), ("all_reduce", "all-reduce (TP)"),
                   ("setup", "set-up (slots, checks, team)"))


def mesh_split(res: dict) -> dict:
    """bench/mesh_profile.py's result → per output token: worker phases and each process's CPU."""
    tokens = res["workload"]["requests"] * res["workload"]["output_len"]
    snap = {label: s for label, s in res.get("worker", [])}
    labels = dict(WORKER_PHASES)
    phases = {key: 1e3 * snap.get(labels[key], 0.0) / tokens for key in STEP_PHASES}
    between = next((s for label, s in res.get("worker", []) if label.startswith("between")), 0.0)
    cpu = {label: 1e3 * s / tokens for label, s in res["processes"]}
    return {"itl_ms": res["itl_ms"], "phases_ms": phases, "between_steps_ms": 1e3 * between / tokens,
            "cpu_ms": cpu, "tokens": tokens}


def table(limits: dict, inproc: dict, mesh: dict) -> str:
    floor = limits["batch1_floor_ms"]
    lin = inproc["linears_only_ms"]
    rows: list[tuple[str, float | None, float | None, str]] = []

    def row(label, a, b, note=""):
        rows.append((label, a, b, note))

    ip, mp = inproc["phases_ms"], mesh["phases_ms"]
    row("ITL p50", inproc["itl_ms"]["median"], mesh["itl_ms"]["median"],
        f"{inproc['itl_ms']['median'] / floor:.2f}x / {mesh['itl_ms']['median'] / floor:.2f}x the floor")
    row("ITL mean", inproc["itl_ms"]["mean"], mesh["itl_ms"]["mean"])
    row("weight-read floor (bytes / bandwidth)", floor, floor,
        f"{limits['batch1_weight_bytes'] / 1e6:.1f} MB at {limits['memory']['read_gb_s']:.1f} GB/s")
    row("linears (linears_only(1), best)", lin, lin, "" if lin is None else f"{lin / floor:.2f}x the floor")
    for key, label in (("one_call", "one-call decode step (C++)"),):
        row(label, ip[key], mp[key])
    step_split = inproc.get("one_call_split_ms")
    if step_split:  # per one-call step (a decode token), in process
        for key, label in ONE_CALL_PHASES:
            if key != "all_reduce" or step_split.get(key, 0.0) > 0:
                row(f"  of it: {label}", step_split.get(key, 0.0), None, "per step, the step's own timers")
    if lin is not None:
        row("  of it: all but the linears + LM head", ip["one_call"] - lin, mp["one_call"] - lin,
            "the step minus linears_only")
    row("prefill matmuls", ip["prefill_matmul"], mp["prefill_matmul"], "the prompt's, spread over the output")
    row("op-by-op attention / element-wise / matmuls", ip["decode_matmul"] + ip["attention"] + ip["elementwise"],
        mp["decode_matmul"] + mp["attention"] + mp["elementwise"], "prefill steps', and steps the one call declines")
    row("sampling", ip["sampling"], mp["sampling"])
    row("runner Python", ip["step"], mp["step"])
    row("worker step RPC", None, mp["rpc"])
    row("worker waits between steps", None, mesh["between_steps_ms"])
    for name in HOPS:
        if name in mesh["cpu_ms"]:
            row(f"CPU: {name}", None, mesh["cpu_ms"][name], "one hop of the token's way" if name != "launcher" else "")
    row("CPU: worker (all its threads)", None, mesh["cpu_ms"].get("worker"))
    row("CPU: machine idle", None, mesh["cpu_ms"].get("machine idle"))
    width = max(len(r[0]) for r in rows) + 2

    def cell(v):
        return f"{v:>11.3f}" if v is not None else f"{'':>11}"
    lines = [f"activations on the blocks: {'int8' if inproc['int8_activations'] else 'float32'}; "
             f"{inproc['decode_tokens']} tokens in process, {mesh['tokens']} through the mesh", "",
             f"{'ms per output token':<{width}}{'in process':>11}{'mesh':>11}  note"]
    lines += [f"{label:<{width}}{cell(a)}{cell(b)}  {note}" for label, a, b, note in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--radixmesh-args", default="", help="extra flags for `radixmesh up`, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    limits = machine_limits(batch=1)
    print(f"floor: {limits['batch1_floor_ms']:.2f} ms ({limits['memory']['read_gb_s']:.1f} GB/s)", flush=True)
    inproc = measure_in_process(args)
    print(f"in process: ITL p50 {inproc['itl_ms']['median']:.2f} ms", flush=True)
    res = measure_mesh(SimpleNamespace(requests=args.requests, concurrency=1, input_len=args.input_len,
                                       output_len=args.output_len, radixmesh_args=args.radixmesh_args,
                                       no_timers=False))
    mesh = mesh_split(res)
    from peer_report import cpu_record
    print()
    print(table(limits, inproc, mesh))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpu": cpu_record(), "args": vars(args),
                       "command": shlex.join(sys.argv), "limits": limits, "in_process": inproc,
                       "mesh": mesh, "mesh_command": res["command"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
