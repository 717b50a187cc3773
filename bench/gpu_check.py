"""The GPU worker's checks on one CUDA machine, in one run of about 8 minutes (issue 19).

    # here, once (PyPI):  .venv/bin/python bench/gpu_prepare.py
    # there (the device tool, carry [".gpu"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
    PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out $OUT

1. kernels: the test files' CUDA-marked tests (pytest -m gpu), pass/fail counts.
2. attention: paged decode attention (Triton; FlashInfer when installed) at 4k/16k/64k tokens
   of context, as a fraction of the device-to-device copy bandwidth measured in the same run
   (target >= 70%). Pages are shuffled, as a long-running pool's are.
3. decode step: one decode step of the default model's shapes at batch 1/8/64 with and without
   CUDA graphs (random weights: the GGUF is over the carry limit; time does not depend on values).
4. mesh: a short `radixmesh up --device cuda` throughput run (bench/peers.py's workload).

Writes gpu_check.json and gpu_check.md (the table for docs/benchmarks.md) to --out.
--smoke runs every section at toy sizes on the CPU (Triton's interpreter) to check the script.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

GPU_TESTS = ["tests/unit/test_triton_attention.py", "tests/unit/test_triton_layer_kernels.py",
             "tests/unit/test_triton_kv_write.py", "tests/unit/test_triton_sampling.py",
             "tests/unit/test_triton_bitmask.py", "tests/unit/test_triton_lora_sgmv.py",
             "tests/unit/test_triton_fp8_gemm.py", "tests/unit/test_flashinfer_backend.py",
             "tests/unit/test_cuda_graphs.py", "tests/unit/test_worker_device.py"]
SMOLLM2_KV = dict(num_kv_heads=3, head_dim=64, num_heads=9)  # MODEL_NOTES.md


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_tests(smoke: bool) -> dict:
    files = [f for f in GPU_TESTS if os.path.exists(os.path.join(ROOT, f))]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    cmd += ["-m", "not slow", "-x"] if smoke else ["-m", "gpu"]
    # The tests turn the interpreter on themselves; TRITON_INTERPRET in the environment (--smoke sets
    # it for this process) would interpret triton's own helpers too and break the sm_90 compiles.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240 if not smoke else 900, env=env)
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
    return {"command": " ".join(cmd[2:]), "returncode": out.returncode, "summary": tail[0]}


def copy_bandwidth(device: torch.device, gib: float) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), device, 10)


def attention(device: torch.device, contexts: list[int], target_bytes: int, copy_bw: float) -> list[dict]:
    from kernels.triton.decode_attention import decode_attention
    rows = []
    hkv, d, h = SMOLLM2_KV["num_kv_heads"], SMOLLM2_KV["head_dim"], SMOLLM2_KV["num_heads"]
    page = 16
    for ctx in contexts:
        per_token = 2 * hkv * d * 2  # K and V, bf16
        batch = max(1, target_bytes // (ctx * per_token))
        pages = batch * ctx // page
        gen = torch.Generator().manual_seed(ctx)
        k = torch.randn(pages * page, hkv, d, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        table = torch.randperm(pages, generator=gen).view(batch, ctx // page).to(device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, h, d, dtype=torch.bfloat16, device=device)
        seconds = timed(lambda: decode_attention(q, k, v, table, lens, page, d ** -0.5, max_kv_len=ctx), device, 20)
        read = batch * ctx * per_token
        row = {"context": ctx, "batch": batch, "kv_bytes": read, "triton_ms": seconds * 1e3,
               "triton_gb_s": read / seconds / 1e9, "fraction_of_copy": read / seconds / copy_bw}
        row.update(flashinfer_decode(q, k, v, table, lens, page, device, read))
        rows.append(row)
        print(f"attention ctx {ctx} B={batch}: {row['triton_ms']:.3f} ms, {row['triton_gb_s']:.0f} GB/s, "
              f"{row['fraction_of_copy']:.0%} of copy", flush=True)
    return rows


def flashinfer_decode(q, k, v, table, lens, page, device, read) -> dict:
    """The same decode through FlashInfer's paged wrapper when it is installed (CUDA only)."""
    if device.type != "cuda":
        return {}
    try:
        import flashinfer
    except ImportError:
        return {"flashinfer": "not installed"}
    batch, pages_each = table.shape
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * pages_each
    last = torch.full((batch,), page, dtype=torch.int32, device=device)
    wrapper.plan(indptr, table.flatten().to(torch.int32), last, q.shape[1], k.shape[1], k.shape[2], page,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    kv = (k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]))
    seconds = timed(lambda: wrapper.run(q, kv), device, 20)
    return {"flashinfer_ms": seconds * 1e3, "flashinfer_gb_s": read / seconds / 1e9}


def random_model(dest: str, smoke: bool) -> str:
    """A Llama of the default model's config (.gpu/smollm2) with random weights, saved as safetensors
    with the real tokenizer; --smoke: two layers."""
    import shutil
    import transformers
    src = os.path.join(ROOT, ".gpu", "smollm2")
    with open(os.path.join(src, "config.json")) as f:
        fields = json.load(f)
    if smoke:
        fields["num_hidden_layers"] = 2
    config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dest)
    return dest


def decode_steps(model_dir: str, device: torch.device, batches: list[int], kv_len: int, backend: str) -> list[dict]:
    from step_profile import decode_plan
    from services.worker.config import WorkerConfig
    from services.worker.loader.checkpoint import load_checkpoint
    from services.worker.model_runner import ModelRunner
    rows = []
    ckpt = load_checkpoint(model_dir)
    for graphs in (False, True):
        if graphs and device.type != "cuda":
            continue
        config = WorkerConfig(model=model_dir, device=str(device), dtype="bfloat16", attention_backend=backend,
                              max_requests=max(batches), kv_cache_bytes=1 << 30, disable_cuda_graph=not graphs,
                              cuda_graph_max_bs=max(batches))
        runner = ModelRunner(config, ckpt)
        for batch in batches:
            step = iter(range(10**6))
            seconds = timed(lambda: runner.execute(decode_plan(runner, batch, kv_len, next(step))), device, 10)
            rows.append({"batch": batch, "cuda_graphs": graphs, "kv_len": kv_len, "step_ms": seconds * 1e3,
                         "tok_s": batch / seconds, "capture_s": runner.device_stats.graph_capture_seconds})
            print(f"decode step B={batch} graphs={graphs}: {seconds * 1e3:.2f} ms", flush=True)
            runner.reset()
        del runner
    return rows


def mesh(model_dir: str, device: torch.device, quick: bool) -> dict:
    out = os.path.join("/tmp", "gpu_check_peers.json")
    cmd = [sys.executable, "bench/peers.py", "--peers", "radixmesh", "--workloads", "throughput", "--skip-limits",
           "--model", model_dir, "--radixmesh-args", f"--device {device}", "--output", out]
    if quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    with open(out) as f:
        return json.load(f)


def markdown(report: dict) -> str:
    lines = [f"GPU check ({report['device_name']}, torch {report['torch']}, {report['date']})", "",
             f"Kernel tests: `{report['kernels']['summary']}`", "",
             f"Device-to-device copy: {report['copy_gb_s']:.0f} GB/s (read + write)", "",
             "| context | batch | Triton decode | GB/s | of copy (target 70%) | FlashInfer GB/s |",
             "|---|---|---|---|---|---|"]
    for r in report["attention"]:
        fi = f"{r['flashinfer_gb_s']:.0f}" if "flashinfer_gb_s" in r else r.get("flashinfer", "n/a")
        lines.append(f"| {r['context']} | {r['batch']} | {r['triton_ms']:.3f} ms | {r['triton_gb_s']:.0f} | "
                     f"{r['fraction_of_copy']:.0%} | {fi} |")
    lines += ["", "| decode batch | eager | CUDA graphs |", "|---|---|---|"]
    by = {(r["batch"], r["cuda_graphs"]): r for r in report["decode"]}
    for b in sorted({r["batch"] for r in report["decode"]}):
        g = by.get((b, True))
        lines.append(f"| {b} | {by[(b, False)]['step_ms']:.2f} ms | {g['step_ms']:.2f} ms |" if g else
                     f"| {b} | {by[(b, False)]['step_ms']:.2f} ms | n/a |")
    tp = report.get("mesh", {}).get("results", {}).get("radixmesh", {}).get("throughput")
    if tp:
        lines += ["", f"Mesh on the device (bench/peers.py throughput workload): {tp['completed']} requests, "
                      f"{tp['output_throughput']:.1f} output tok/s, ITL p50 {tp['itl_ms']['median']:.2f} ms"]
    elif report.get("mesh", {}).get("error"):
        lines += ["", "Mesh run failed: see gpu_check.json"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU under Triton's interpreter")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: kernels,attention,decode,mesh")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, contexts, target, batches, kv_len, backend = torch.device("cpu"), [256], 1 << 20, [1, 2], 64, "triton"
    else:
        device, contexts, target, batches, kv_len, backend = torch.device("cuda"), [4096, 16384, 65536], 1 << 30, \
            [1, 8, 64], 1024, "auto"
    os.makedirs(args.out, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "host": platform.node(),
              "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"}
    report["kernels"] = kernel_tests(args.smoke) if "kernels" not in skip else {"summary": "skipped"}
    print("kernels:", report["kernels"]["summary"], flush=True)
    report["copy_gb_s"] = copy_bandwidth(device, 1.0 if device.type == "cuda" else 0.01) / 1e9
    report["attention"] = attention(device, contexts, target, report["copy_gb_s"] * 1e9) \
        if "attention" not in skip else []
    model_dir = random_model("/tmp/gpu_check_model", args.smoke)
    report["decode"] = decode_steps(model_dir, device, batches, kv_len, backend) if "decode" not in skip else []
    report["mesh"] = mesh(model_dir, device, args.smoke) if "mesh" not in skip else {}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
