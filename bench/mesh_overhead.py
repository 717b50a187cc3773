"""What the gRPC mesh costs: output throughput, inter-token latency (ITL) and the front
services' CPU of the same requests through `radixmesh up` (OpenAI HTTP streaming → gateway →
tokenizer → scheduler ⇄ worker; outputs scheduler → detokenizer → tokenizer → gateway) and
through the in-process Engine (issue 33).

Two workloads, both with the defaults of `radixmesh up` and of the Engine (bfloat16 where the CPU
has it): the throughput workload (--requests-tp requests, --concurrency-tp in flight, 256-token
prompts, 128 output tokens; bench/peers.py's) and a single stream (--requests-c1 at concurrency 1).

Requests: random ordinary-vocabulary prompts of --input-len token ids (sent as token ids, so
both sides see the same ids and the prefix cache never hits), --output-len tokens, greedy,
ignore_eos. Concurrency c keeps c requests in flight (the next starts when one ends).

The two are never measured at once: both are loaded first (the Engine in this process, the
mesh as a child `radixmesh up --http-port 0`), then each run happens with the other idle,
interleaved per workload (Engine, mesh, Engine, mesh, ...) so that a slow drift of the machine
hits both alike.

Metrics, computed the same way on both sides: an *event* is a streamed text delta (an SSE
event with text from the gateway; a RequestOutput with text from the Engine). TTFT = first event
− send; ITL = gaps between consecutive events of a request (pooled; mean, median, p90); TPOT =
(last − first event) / (tokens − 1) per request, averaged; output throughput = output tokens /
wall time. Front CPU = the CPU seconds (/proc) of every mesh process but the worker (gateway,
tokenizer, detokenizer, scheduler, the launcher) during the mesh's throughput run, per output token.

Gates (printed, never asserted): mesh / in-process throughput >= 0.95, front CPU <= 0.3 ms per
output token, single-stream mesh ITL <= 1.05x in-process.

    .venv/bin/python bench/mesh_overhead.py [--mesh-flags "--pin-lead-cpu 1"] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))  # proc_cpu

from services.loadgen.metrics import percentile  # noqa: E402  (one percentile rule for every bench)

TARGET_ITL_RATIO = 1.05  # single stream: mesh ITL / in-process ITL
TARGET_THROUGHPUT_RATIO = 0.95
TARGET_FRONT_CPU_MS = 0.3  # front services' CPU per output token


# --- metrics (pure: tested on recorded streams by tests/integration/test_bench_mesh_overhead.py) ----

@dataclass
class RequestRecord:
    """One streamed request: when it was sent, when each text event arrived, how many tokens."""
    sent: float
    events: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def itl_samples(events: list[float]) -> list[float]:
    """Gaps between consecutive events of one request."""
    return [b - a for a, b in zip(events, events[1:])]


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """Pooled ITL (mean, median, p90), mean TTFT and TPOT, output throughput."""
    itl = [gap for r in records for gap in itl_samples(r.events)]
    ttft = [r.events[0] - r.sent for r in records if r.events]
    tpot = [(r.events[-1] - r.events[0]) / (r.tokens - 1) for r in records if r.events and r.tokens > 1]
    tokens = sum(r.tokens for r in records)
    return {"requests": len(records), "output_tokens": tokens, "wall_s": wall_s,
            "itl_mean_ms": 1e3 * mean(itl), "itl_median_ms": 1e3 * percentile(itl, 50),
            "itl_p90_ms": 1e3 * percentile(itl, 90), "itl_samples": len(itl),
            "ttft_mean_ms": 1e3 * mean(ttft), "tpot_mean_ms": 1e3 * mean(tpot),
            "output_tok_s": tokens / wall_s if wall_s > 0 else math.nan}


RATIO_KEYS = ("itl_mean_ms", "itl_median_ms", "itl_p90_ms", "ttft_mean_ms", "tpot_mean_ms", "output_tok_s")


def ratios(in_process: dict, mesh: dict) -> dict:
    """mesh / in-process for each metric (throughput: > 1 means the mesh is faster)."""
    return {k: mesh[k] / in_process[k] if in_process[k] else math.nan for k in RATIO_KEYS}


def sse_record(sent: float, lines: list[tuple[float, bytes]]) -> RequestRecord:
    """A RequestRecord from the timestamped lines of an OpenAI completions SSE stream
    (stream_options.include_usage: the last chunk's usage gives the token count). Raises
    RuntimeError on an error event or a stream without [DONE]."""
    rec, done = RequestRecord(sent), False
    for t, raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"error event: {obj['error']}")
        if obj.get("usage"):
            rec.tokens = obj["usage"]["completion_tokens"]
        for choice in obj.get("choices", []):
            if choice.get("text"):
                rec.events.append(t)
                rec.text += choice["text"]
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return rec


def timed_lines(chunks: list[tuple[float, bytes]]) -> list[tuple[float, bytes]]:
    """The lines of a stream read as timestamped chunks, each at the time of the chunk that
    completed it. The client reads whatever arrived (one read per gateway write, mostly) and
    splits lines afterwards: a line-by-line reader costs the client CPU per line, and on a
    2-core machine that CPU is taken from the system it measures."""
    lines, pending = [], b""
    for t, chunk in chunks:
        *done, pending = (pending + chunk).split(b"\n")
        lines.extend((t, line) for line in done)
    if pending:
        lines.append((chunks[-1][0], pending))
    return lines


def format_table(results: dict) -> str:
    """The printed table: per concurrency, in-process, mesh and their ratio."""
    head = (f"{'conc':>4}  {'':<16}{'ITL mean':>10}{'ITL p50':>10}{'ITL p90':>10}{'TTFT mean':>11}"
            f"{'TPOT':>9}{'out tok/s':>11}")
    rows = [head, "-" * len(head)]
    for conc, r in results.items():
        if len(rows) > 2:
            rows.append("")
        for name, key in (("in-process", "in_process"), ("mesh", "mesh")):
            m = r[key]
            rows.append(f"{conc:>4}  {name:<16}{m['itl_mean_ms']:>8.1f}ms{m['itl_median_ms']:>8.1f}ms"
                        f"{m['itl_p90_ms']:>8.1f}ms{m['ttft_mean_ms']:>9.1f}ms{m['tpot_mean_ms']:>7.1f}ms"
                        f"{m['output_tok_s']:>11.1f}")
        q = r["ratio"]
        rows.append(f"{conc:>4}  {'mesh/in-process':<16}{q['itl_mean_ms']:>9.3f}x{q['itl_median_ms']:>9.3f}x"
                    f"{q['itl_p90_ms']:>9.3f}x{q['ttft_mean_ms']:>10.3f}x{q['tpot_mean_ms']:>8.3f}x"
                    f"{q['output_tok_s']:>10.3f}x")
    verdicts = [f"c={c}: mesh ITL mean {r['ratio']['itl_mean_ms']:.3f}x in-process "
                f"({'meets' if r['ratio']['itl_mean_ms'] <= TARGET_ITL_RATIO else 'MISSES'} <= {TARGET_ITL_RATIO}x)"
                for c, r in results.items() if c == 1]
    for c, r in results.items():
        if c != 1:
            q = r["ratio"]["output_tok_s"]
            verdicts.append(f"c={c}: mesh throughput {q:.3f}x in-process "
                            f"({'meets' if q >= TARGET_THROUGHPUT_RATIO else 'MISSES'} >= {TARGET_THROUGHPUT_RATIO}x)")
        if "front_cpu_ms_per_token" in r:  # the gate is the throughput workload's; c=1 for the record
            ms = r["front_cpu_ms_per_token"]
            gate = f"{'meets' if ms <= TARGET_FRONT_CPU_MS else 'MISSES'} <= {TARGET_FRONT_CPU_MS} ms; " if c != 1 else ""
            verdicts.append(f"c={c}: front services' CPU {ms:.3f} ms per output token ({gate}"
                            + ", ".join(f"{k} {v:.3f}" for k, v in r["front_cpu_ms_by_service"].items()) + ")")
    return "\n".join(rows + [""] + verdicts)


# --- the two systems -------------------------------------------------------------------

def random_prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    # Ordinary vocabulary ids: skip the special tokens at the start of SmolLM2's vocabulary.
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


async def run_concurrent(prompts: list[list[int]], concurrency: int, one) -> tuple[list[RequestRecord], float]:
    """At most `concurrency` of `one(ids)` in flight; returns (records in prompt order, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(ids):
        async with gate:
            return await one(ids)

    t0 = time.perf_counter()
    records = await asyncio.gather(*(gated(ids) for ids in prompts))
    return list(records), time.perf_counter() - t0


class InProcess:
    def __init__(self, args) -> None:
        from services.engine.engine import Engine
        from services.scheduler.config import SchedulerConfig
        from services.worker.config import WorkerConfig

        worker = WorkerConfig(model=args.model, kv_cache_bytes=args.kv_cache_bytes)
        self.engine = Engine(model=args.model, worker=worker,
                             scheduler=SchedulerConfig(max_running_requests=worker.max_requests))

    async def one(self, ids: list[int], max_tokens: int) -> RequestRecord:
        from services.common.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True)
        rec = RequestRecord(time.perf_counter())
        async for chunk in self.engine.stream(input_ids=ids, sampling=sp):
            if chunk.text:
                rec.events.append(time.perf_counter())
                rec.text += chunk.text
            if chunk.error:
                raise RuntimeError(chunk.error)
            rec.tokens = chunk.completion_tokens
        return rec

    def close(self) -> None:
        self.engine.shutdown()


class Mesh:
    """`radixmesh up --http-port 0` as a child; its URL from the line it prints when ready."""

    def __init__(self, args, extra_flags: list[str] = ()) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mesh_overhead-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0"]
        cmd += (["--kv-cache-bytes", str(args.kv_cache_bytes)] if args.kv_cache_bytes else [])
        cmd += ["--model", args.model] if args.model else []
        cmd += list(extra_flags)
        self.command = " ".join(cmd[2:])
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.url = None
        for line in self.proc.stdout:  # blocks until ready (or the launcher exits)
            if line.startswith("radixmesh is up: "):
                self.url = line.removeprefix("radixmesh is up: ").split(";")[0]
                break
        if self.url is None:
            self.log.seek(0)
            raise RuntimeError(f"radixmesh up failed (exit {self.proc.wait()}):\n{self.log.read()[-3000:]}")
        self.session = None
        self.model = None

    async def start_session(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))
        async with self.session.get(self.url + "/v1/models") as r:
            self.model = (await r.json())["data"][0]["id"]

    async def one(self, ids: list[int], max_tokens: int) -> RequestRecord:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            chunks = [(time.perf_counter(), chunk) async for chunk in r.content.iter_any()]
        return sse_record(sent, timed_lines(chunks))

    async def close_session(self) -> None:
        if self.session is not None:
            await self.session.close()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def front_cpu_seconds(mesh: Mesh) -> dict[str, float]:
    """CPU seconds so far of every mesh process but the worker, by service (and the launcher)."""
    import proc_cpu

    procs = {name: pid for name, pid in proc_cpu.mesh_children(mesh.proc.pid).items()
             if not name.startswith("worker")}
    procs["launcher"] = mesh.proc.pid
    return {name: proc_cpu.process_cpu_seconds(pid) or 0.0 for name, pid in procs.items()}


async def measure(args, engine: InProcess, mesh: Mesh, rng: random.Random) -> dict:
    await mesh.start_session()
    try:
        warm = random_prompts(4, args.input_len, rng)
        for system in (engine, mesh):  # torch's first steps, connections, caches of the code paths
            await run_concurrent(warm, 4, lambda ids, s=system: s.one(ids, 8))
        results = {}
        for conc, n in ((1, args.requests_c1), (args.concurrency_tp, args.requests_tp)):
            runs: dict[str, list] = {"in_process": [], "mesh": []}
            same, front = 0, {}
            for _ in range(args.rounds):  # fresh prompts per round (no prefix-cache hits), the same for both
                prompts = random_prompts(n, args.input_len, rng)
                for key, system in (("in_process", engine), ("mesh", mesh)):
                    cpu0 = front_cpu_seconds(mesh) if key == "mesh" else None
                    recs, wall = await run_concurrent(prompts, conc, lambda ids, s=system: s.one(ids, args.output_len))
                    if cpu0 is not None:
                        for name, t in front_cpu_seconds(mesh).items():
                            front[name] = front.get(name, 0.0) + t - cpu0.get(name, 0.0)
                    bad = [r.tokens for r in recs if r.tokens != args.output_len]
                    if bad:
                        raise RuntimeError(f"{key}: requests produced {bad[:5]} tokens, not {args.output_len}")
                    runs[key].append((recs, wall))
                    print(f"  c={conc} {key:<10} {wall:6.1f}s", flush=True)
                same += sum(a.text == b.text for a, b in zip(runs["in_process"][-1][0], runs["mesh"][-1][0]))
            r = {key: summarize([x for recs, _ in rs for x in recs], sum(w for _, w in rs))
                 for key, rs in runs.items()}
            r["same_text"] = f"{same}/{n * args.rounds}"  # greedy text equal on both sides
            r["ratio"] = ratios(r["in_process"], r["mesh"])
            tokens = r["mesh"]["output_tokens"]
            r["front_cpu_ms_by_service"] = {k: 1e3 * v / tokens for k, v in sorted(front.items())}
            r["front_cpu_ms_per_token"] = 1e3 * sum(front.values()) / tokens
            results[conc] = r
        return results
    finally:
        await mesh.close_session()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests-c1", type=int, default=8, help="requests of the single-stream workload")
    p.add_argument("--requests-tp", type=int, default=64, help="requests of the throughput workload")
    p.add_argument("--concurrency-tp", type=int, default=64, help="in flight in the throughput workload")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="runs of each system per concurrency, interleaved")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="default: both sides' own default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh-flags", default="", help='extra `radixmesh up` flags, e.g. "--pin-lead-cpu 1"')
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    import torch

    rng = random.Random(args.seed)
    info = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "torch_threads": torch.get_num_threads(), "args": vars(args)}
    print("loading the in-process Engine ...", flush=True)
    engine = InProcess(args)
    print("starting radixmesh up ...", flush=True)
    try:
        mesh = Mesh(args, args.mesh_flags.split())
    except BaseException:
        engine.close()
        raise
    print(f"mesh at {mesh.url} ({mesh.command}); measuring", flush=True)
    try:
        results = asyncio.run(measure(args, engine, mesh, rng))
    finally:
        engine.close()
        code = mesh.close()
    info["mesh_exit"] = code
    if code == 0:
        os.unlink(mesh.log.name)
    else:
        print(f"radixmesh up exited {code}; its log: {mesh.log.name}", file=sys.stderr)
    print()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "results": {str(c): r for c, r in results.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
