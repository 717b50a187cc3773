"""Where the wall time of the 64-concurrent workload goes through the mesh (issue 22, "profile first").

`radixmesh up` (plus --radixmesh-args) serves the throughput workload of bench/peers.py (64
concurrent clients, 256-token prompts, 128 output tokens, ignore_eos; --requests, --concurrency,
--input-len, --output-len shrink it for a smoke run) after a short warm-up. Over the measured
window it reports two views of the same wall time:

1. The worker's step thread, wall seconds: prefill matmuls, decode matmuls, attention, the
   one-call decode step of small batches, element-wise ops, sampling, the runner's Python, the
   service's per-step RPC work, and the time between steps (the worker waiting for the next
   plan). The worker gets bench/phase_timers.py's timers through bench/phase_hook (a
   sitecustomize on its PYTHONPATH; services/ is unchanged); they add a few microseconds per
   wrapped call (--no-timers: measure without them, and without this view).
2. CPU seconds of every mesh process (/proc/<pid>/stat: gateway, tokenizer, detokenizer,
   scheduler, worker, the launcher), this process (the load generator), the rest of the machine,
   and the machine's idle time (/proc/stat), as shares of cores x wall.

    .venv/bin/python bench/mesh_profile.py [--requests 64] [--json bench/results/mesh-profile.json]
    .venv/bin/python bench/mesh_profile.py --requests 4 --concurrency 4 --output-len 16   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

import proc_cpu  # noqa: E402
from phase_timers import SNAPSHOT_INTERVAL_S, read_snapshot  # noqa: E402

# (phase key in the worker's snapshot, label), in the order the table prints them
WORKER_PHASES = [
    ("prefill_matmul", "prefill matmuls"),
    ("decode_matmul", "decode matmuls"),
    ("attention", "attention (prepare + forward)"),
    ("one_call", "one-call decode steps (matmuls + attention)"),
    ("elementwise", "element-wise ops (norms, RoPE, SiLU)"),
    ("sampling", "sampling"),
    ("step", "runner Python (admission, layout, glue)"),
    ("rpc", "step RPC (proto conversion, lock, metrics)"),
]


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def worker_rows(before: dict, after: dict, wall_s: float) -> list[tuple[str, float]]:
    """Two phase snapshots → [(label, wall seconds)] that add up to wall_s: the phases, then the
    time between steps (wall minus the inclusive time of the worker's step RPCs)."""
    d = delta(after["seconds"], before["seconds"])
    rows = [(label, d.get(key, 0.0)) for key, label in WORKER_PHASES]
    busy = after["inclusive"].get("rpc", 0.0) - before["inclusive"].get("rpc", 0.0)
    rows.append(("between steps (worker waits for a plan)", wall_s - busy))
    return rows


def process_rows(cpu: dict[str, float], own_s: float, machine_busy_s: float, machine_idle_s: float
                 ) -> list[tuple[str, float]]:
    """CPU seconds over the window → [(label, seconds)] that add up to the machine's capacity
    (busy + idle): each mesh process, the load generator, everything else, idle."""
    rows = sorted(cpu.items(), key=lambda kv: kv[0] != "worker")  # the worker first
    rows.append(("load generator (this process)", own_s))
    rows.append(("other processes", machine_busy_s - sum(cpu.values()) - own_s))
    rows.append(("machine idle", machine_idle_s))
    return rows


def format_rows(title: str, rows: list[tuple[str, float]], whole: float, unit: str) -> str:
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{title}", f"  {'':<{width}}{unit:>9}  {'share':>6}"]
    for label, s in rows:
        lines.append(f"  {label:<{width}}{s:>9.2f}  {100 * s / whole if whole else 0:>5.1f}%")
    lines.append(f"  {'total':<{width}}{sum(s for _, s in rows):>9.2f}  {'':>6}")
    return "\n".join(lines)


# --- measuring ---------------------------------------------------------------------------

def workload(args):
    """bench/peers.py's throughput workload, resized by the flags."""
    from peers import workloads
    tput = next(w for w in workloads(quick=False) if w.name == "throughput").bench
    return replace(tput, num_prompts=args.requests, max_concurrency=args.concurrency, input_len=args.input_len,
                   output_len=args.output_len, warmup_requests=0, progress=False)


def cpu_snapshot(launcher: int, children: dict[str, int]) -> tuple[dict[str, float], float, tuple[float, float]]:
    procs = {"launcher": launcher, **children}
    cpu = {name: proc_cpu.process_cpu_seconds(pid) or 0.0 for name, pid in procs.items()}
    return cpu, proc_cpu.process_cpu_seconds(os.getpid()) or 0.0, proc_cpu.machine_seconds()


def fresh_snapshot(path: str, since: float) -> dict:
    """The worker's phase snapshot written after `since` (time.time())."""
    deadline = time.monotonic() + 10 * SNAPSHOT_INTERVAL_S + 5
    while time.monotonic() < deadline:
        try:
            snap = read_snapshot(path)
            if snap["time"] > since:
                return snap
        except (OSError, ValueError):
            pass
        time.sleep(SNAPSHOT_INTERVAL_S / 2)
    raise RuntimeError(f"the worker wrote no phase timers to {path}: was bench/phase_hook on its PYTHONPATH?")


def measure(args) -> dict:
    from peer_servers import Server
    from services.loadgen.cli import run_bench
    from services.loadgen.words import load_pool

    timers = None
    if not args.no_timers:  # the worker replaces this file with its snapshots
        with tempfile.NamedTemporaryFile(prefix="mesh-phases-", suffix=".json", delete=False) as f:
            timers = f.name
    env = dict(os.environ)
    if timers:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(BENCH, "phase_hook"), env.get("PYTHONPATH")]))
        env["RADIXMESH_PHASE_TIMERS"] = timers
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0"] + shlex.split(args.radixmesh_args)
    cfg, pool = workload(args), load_pool("default")
    with Server(cmd, None, env=env) as server:
        children = proc_cpu.mesh_children(server.proc.pid)
        warm = replace(cfg, base_url=server.url, num_prompts=min(4, cfg.num_prompts), output_len=8,
                       max_concurrency=min(4, cfg.num_prompts), seed=cfg.seed + 1)  # other prompts: no cache hits
        run_bench(warm, pool)  # the first steps, connections, the code paths' caches
        time.sleep(2 * SNAPSHOT_INTERVAL_S)
        phases0 = fresh_snapshot(timers, time.time() - SNAPSHOT_INTERVAL_S) if timers else None
        cpu0, own0, (busy0, idle0) = cpu_snapshot(server.proc.pid, children)
        t0 = time.perf_counter()
        doc, _ = run_bench(replace(cfg, base_url=server.url), pool)
        wall = time.perf_counter() - t0
        cpu1, own1, (busy1, idle1) = cpu_snapshot(server.proc.pid, children)
        end = time.time()
        phases1 = fresh_snapshot(timers, end) if timers else None
    if timers:
        os.unlink(timers)
    summary = doc["runs"][0]["summary"]
    out = {"command": "radixmesh " + shlex.join(cmd[4:]), "workload": {
        "requests": cfg.num_prompts, "concurrency": cfg.max_concurrency, "input_len": cfg.input_len,
        "output_len": cfg.output_len}, "wall_s": wall, "output_throughput": summary["output_throughput"],
        "itl_ms": summary["itl_ms"],
        "completed": summary["completed"], "cores": os.cpu_count(), "children": children,
        "processes": process_rows(delta(cpu1, cpu0), own1 - own0, busy1 - busy0, idle1 - idle0)}
    if phases1 is not None:
        out["worker"] = worker_rows(phases0, phases1, wall)
        out["worker_counters"] = delta(phases1["counters"], phases0["counters"])
    return out


def report(res: dict) -> str:
    w = res["workload"]
    head = (f"{w['requests']} requests x {w['input_len']}->{w['output_len']} tokens, {w['concurrency']} concurrent: "
            f"{res['wall_s']:.2f} s wall, {res['output_throughput']:.1f} output tok/s ({res['completed']} completed)")
    parts = [head]
    if "worker" in res:
        c = res["worker_counters"]
        parts.append(f"worker: {c.get('steps', 0)} steps ({c.get('steps_with_prefill', 0)} with prefill), "
                     f"{c.get('prefill_tokens', 0)} prefill + {c.get('decode_tokens', 0)} decode tokens")
        parts.append(format_rows("worker step thread, wall time:", res["worker"], res["wall_s"], "s"))
    parts.append(format_rows(f"CPU time over the same window ({res['cores']} cores x wall = capacity):",
                             res["processes"], res["cores"] * res["wall_s"], "cpu s"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--radixmesh-args", default="", help="extra flags for `radixmesh up`, one string")
    p.add_argument("--no-timers", action="store_true", help="no per-phase timers in the worker (CPU view only)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    res = measure(args)
    res["date"] = time.strftime("%Y-%m-%d")
    from peer_report import cpu_record
    res["cpu"] = cpu_record()
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**res, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
