"""Quantization on the default model (issue 21), one run: accuracy, KV capacity, speed, memory.

Parts (--parts, comma-separated; all by default):
  table       perplexity (the bundled corpora, through the worker's paged prefill: services/eval) and
              greedy agreement with float32 over the bundled prompts, for float32, bfloat16, FP8 KV
              (e4m3, e5m2; bfloat16 weights), int8 weights (float32 activations), FP8 weights (bfloat16) and every GGUF format
              re-quantized by `radixmesh quantize` from the default file (computed on its blocks,
              --quantization gguf, float32 activations); the gates printed pass/fail; the float32
              harness checked against transformers on the same windows (--no-reference skips it).
  capacity    KV capacity in tokens at one byte budget (--kv-cache-bytes), fp8 vs bf16.
  kv-speed    output tokens/s of --requests concurrent requests with a KV budget that makes bf16
              retract (--kv-budget-tokens of bf16), fp8 vs bf16 at the same bytes; retractions counted.
  weights     single-stream ITL and --requests-concurrent throughput per weight format vs today's
              default, and each format's resident weight bytes (ModelRunner.weight_bytes).

    .venv/bin/python bench/quantization.py [--parts table,capacity,kv-speed,weights] [--max-tokens 2048]
        [--formats Q8_0,Q4_K] [--json bench/results/quantization-<date>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import random
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.eval.agreement import agreement  # noqa: E402
from services.eval.perplexity import perplexity  # noqa: E402
from services.eval.runs import corpus_tokens, engine_outputs  # noqa: E402
from services.quantize.cli import QuantizeConfig, convert  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.tokenizer.text_tokenizer import load_tokenizer  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402

PARTS = ("table", "capacity", "kv-speed", "weights")
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
GATE = 1.01  # FP8 KV vs bf16 KV, int8 vs float32: at most +1% perplexity


class Models:
    """The default file and its re-quantized copies (made on first use), each loaded once per quantization."""

    def __init__(self, workdir: str):
        self.default = default_model_path()
        self.workdir = workdir
        self.tokenizer = load_tokenizer(self.default)
        self._checkpoints: dict[tuple[str, str], object] = {}

    def path(self, fmt: str | None) -> str:
        if fmt is None:
            return self.default
        out = os.path.join(self.workdir, f"SmolLM2-135M-Instruct.{fmt}.gguf")
        if not os.path.exists(out):
            print(f"  {convert(QuantizeConfig(model=self.default, out=out, type=fmt)).summary()}", flush=True)
        return out

    def checkpoint(self, path: str, quantization: str):
        key = (path, "gguf" if quantization == "gguf" else "dense")
        if key not in self._checkpoints:
            self._checkpoints.clear()  # one at a time: 2 cores, little memory to spare
            self._checkpoints[key] = load_checkpoint(path, quantization)
        return self._checkpoints[key]


def table_rows(formats: list[str]) -> dict[str, tuple[str | None, WorkerConfig]]:
    """name → (GGUF format re-quantized from the default file, or None: the file itself; worker flags)."""
    rows = {
        "float32": (None, WorkerConfig(dtype="float32")),
        "bf16": (None, WorkerConfig(dtype="bfloat16")),
        "fp8_e4m3 KV": (None, WorkerConfig(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")),
        "fp8_e5m2 KV": (None, WorkerConfig(dtype="bfloat16", kv_cache_dtype="fp8_e5m2")),
        "int8 weights": (None, WorkerConfig(dtype="float32", quantization="int8")),
        "fp8 weights": (None, WorkerConfig(dtype="bfloat16", quantization="fp8")),  # no gate: reported vs bf16
    }
    for fmt in formats:
        rows[f"gguf {fmt}"] = (fmt, WorkerConfig(dtype="float32", quantization="gguf"))
    return rows


def part_table(models: Models, args) -> dict:
    budget = 256 << 20
    windows = dict(window=args.window, stride=args.stride, chunk=args.chunk)
    tokens = {c: corpus_tokens(models.default, c, args.max_tokens, models.tokenizer) for c in args.corpora}
    reference = engine_outputs(WorkerConfig(dtype="float32", kv_cache_bytes=budget), args.new_tokens,
                               models.checkpoint(models.default, "auto"), models.tokenizer)
    out: dict = {"rows": {}}
    for name, (fmt, worker) in table_rows(args.formats).items():
        if args.skip and name in args.skip:
            continue
        path = models.path(fmt)
        worker = replace(worker, model=path, kv_cache_bytes=budget)
        ckpt = models.checkpoint(path, worker.quantization)
        runner = ModelRunner(worker, ckpt)
        ppl = {c: perplexity(runner, t, **windows).perplexity for c, t in tokens.items()}
        del runner
        agree = agreement(reference, engine_outputs(worker, args.new_tokens, ckpt, models.tokenizer), args.new_tokens)
        out["rows"][name] = {"perplexity": ppl, "agreement": agree.mean_fraction, "agreement_exact": agree.exact}
        print(f"  {name:14s} " + "  ".join(f"ppl[{c}] {p:8.4f}" for c, p in ppl.items())
              + f"  agreement {agree.mean_fraction:.3f} ({agree.exact}/{len(agree.matched)} exact)", flush=True)
    if args.reference:
        out["transformers_float32"] = transformers_check(models, tokens, args)
    out["gates"] = gates(out)
    return out


def transformers_check(models: Models, tokens: dict[str, list[int]], args) -> dict:
    from transformers import AutoModelForCausalLM
    from services.eval.reference import transformers_perplexity
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(models.default),
                                              gguf_file=os.path.basename(models.default), dtype=torch.float32).eval()
    return {c: transformers_perplexity(hf, t, args.window, args.stride).perplexity for c, t in tokens.items()}


def gates(out: dict) -> dict:
    rows, result = out["rows"], {}

    def ratio_gate(name: str, base: str, limit: float) -> None:
        if name in rows and base in rows:
            worst = max(rows[name]["perplexity"][c] / rows[base]["perplexity"][c] for c in rows[base]["perplexity"])
            result[f"{name} <= {limit:g}x {base}"] = {"ratio": worst, "pass": worst <= limit}

    ratio_gate("fp8_e4m3 KV", "bf16", GATE)
    ratio_gate("fp8_e5m2 KV", "bf16", GATE)
    ratio_gate("int8 weights", "float32", GATE)
    if "fp8 weights" in rows and "bf16" in rows:  # the issue gates int8 only; FP8 weights' cost is reported
        worst = max(rows["fp8 weights"]["perplexity"][c] / rows["bf16"]["perplexity"][c] for c in rows["bf16"]["perplexity"])
        print(f"  fp8 weights vs bf16: {worst:.4f}x perplexity (no gate)")
    if "transformers_float32" in out and "float32" in rows:
        worst = max(abs(rows["float32"]["perplexity"][c] / p - 1) for c, p in out["transformers_float32"].items())
        result["float32 harness within 0.1% of transformers"] = {"ratio": 1 + worst, "pass": worst <= 1e-3}
    for name, g in result.items():
        print(f"  gate {name}: {g['ratio']:.4f} {'PASS' if g['pass'] else 'FAIL'}")
    return result


def part_capacity(models: Models, args) -> dict:
    ckpt = models.checkpoint(models.default, "auto")
    tokens = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = ModelRunner(WorkerConfig(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=args.kv_cache_bytes), ckpt)
        tokens[kv] = runner.kv_spec.num_pages * runner.kv_spec.page_size
        del runner
    ratio = tokens["fp8_e4m3"] / tokens["auto"]
    print(f"  KV capacity at {args.kv_cache_bytes} bytes: bf16 {tokens['auto']} tokens, fp8 {tokens['fp8_e4m3']} "
          f"tokens: {ratio:.3f}x (target >= 1.9x) {'PASS' if ratio >= 1.9 else 'FAIL'}")
    return {"bytes": args.kv_cache_bytes, "bf16_tokens": tokens["auto"], "fp8_tokens": tokens["fp8_e4m3"], "ratio": ratio}


def throughput(engine: Engine, prompts: list[list[int]], output_tokens: int) -> float:
    """Submit all at once → output tokens per second."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=output_tokens, ignore_eos=True)
    sinks = [queue.SimpleQueue() for _ in prompts]
    t0 = time.perf_counter()
    for ids, q in zip(prompts, sinks):
        engine.submit(ids, sp, q.put)
    n = 0
    for q in sinks:
        while True:
            chunk = q.get()
            if chunk.error:
                raise RuntimeError(chunk.error)
            n += len(chunk.token_ids)
            if chunk.finished:
                break
    return n / (time.perf_counter() - t0)


def single_stream_itl(engine: Engine, prompt: list[int], output_tokens: int) -> float:
    """Mean seconds between tokens after the first, one request alone."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=output_tokens, ignore_eos=True)
    q: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit(prompt, sp, q.put)
    stamps, n = [], 0
    while True:
        chunk = q.get()
        if chunk.error:
            raise RuntimeError(chunk.error)
        n += len(chunk.token_ids)
        stamps.append((time.perf_counter(), n))
        if chunk.finished:
            break
    (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
    return (t_last - t_first) / max(n_last - n_first, 1)


def prompts_of(args, n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(args.prompt_tokens)] for _ in range(n)]


def part_kv_speed(models: Models, args) -> dict:
    ckpt = models.checkpoint(models.default, "auto")
    bf16_token_bytes = 2 * 30 * 3 * 64 * 2  # SmolLM2: layers x kv heads x head dim, K and V, 2 bytes
    budget = args.kv_budget_tokens * bf16_token_bytes
    prompts, out = prompts_of(args, args.requests), {"kv_cache_bytes": budget}
    for kv in ("auto", "fp8_e4m3"):
        worker = WorkerConfig(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=budget, max_requests=args.requests)
        engine = Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=args.requests),
                        checkpoint=ckpt, tokenizer=models.tokenizer)
        try:
            throughput(engine, prompts[:4], 4)  # warm-up
            before = engine.scheduler.stats.retracted
            tps = throughput(engine, prompts, args.output_tokens)
            out["bf16" if kv == "auto" else "fp8_e4m3"] = {
                "tok_s": tps, "retracted": engine.scheduler.stats.retracted - before,
                "kv_tokens": engine.limits.num_pages * engine.limits.page_size}
        finally:
            engine.shutdown()
    out["ratio"] = out["fp8_e4m3"]["tok_s"] / out["bf16"]["tok_s"]
    for k in ("bf16", "fp8_e4m3"):
        print(f"  {args.requests} concurrent, {k} KV ({out[k]['kv_tokens']} tokens): {out[k]['tok_s']:.1f} tok/s, "
              f"{out[k]['retracted']} retractions")
    print(f"  fp8 vs bf16 KV throughput: {out['ratio']:.3f}x (target >= 1.5x)")
    return out


def part_weights(models: Models, args) -> dict:
    # Each format twice: `gguf` (the blocks only, at every batch size: the least memory) and
    # `auto` (dense bf16 for big steps, the file's blocks and the one-call decode stack for steps
    # of <= --quant-max-rows rows: the format computed in its own format where that is faster).
    rows = {"default": (None, WorkerConfig()), "int8": (None, WorkerConfig(quantization="int8")),
            "fp8": (None, WorkerConfig(quantization="fp8"))}
    for fmt in args.formats:
        rows[fmt] = (fmt, WorkerConfig(quantization="gguf"))
        rows[f"{fmt} auto"] = (fmt, WorkerConfig(quantization="auto"))
    prompts, out = prompts_of(args, args.requests), {}
    for name, (fmt, worker) in rows.items():
        if name != "default" and (name in args.skip or f"gguf {name}" in args.skip or f"{name} weights" in args.skip):
            continue
        path = models.path(fmt)
        worker = replace(worker, model=path, kv_cache_bytes=1 << 30, max_requests=args.requests)
        engine = Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=args.requests),
                        checkpoint=models.checkpoint(path, worker.quantization), tokenizer=models.tokenizer)
        try:
            throughput(engine, prompts[:4], 4)  # warm-up
            itl = single_stream_itl(engine, prompts[0], args.itl_tokens)
            tps = throughput(engine, prompts, args.output_tokens)
            out[name] = {"itl_ms": itl * 1e3, "tok_s": tps, "weight_bytes": getattr(engine.runner, "weight_bytes", None)}
        finally:
            engine.shutdown()
        base = out["default"]
        wb = out[name]["weight_bytes"]
        print(f"  {name:12s} ITL {out[name]['itl_ms']:6.2f} ms ({base['itl_ms'] / out[name]['itl_ms']:.3f}x default's speed)"
              f"  {args.requests} concurrent {tps:7.1f} tok/s ({tps / base['tok_s']:.3f}x)"
              f"  weights {wb / 2**20 if wb else float('nan'):.1f} MiB", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--formats", default=",".join(FORMATS), help="GGUF formats to re-quantize and measure")
    ap.add_argument("--corpora", default="kjv,code")
    ap.add_argument("--max-tokens", type=int, default=2048, help="perplexity: tokens of each corpus")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32, help="agreement: greedy tokens per prompt")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip the transformers check of the float32 harness")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="capacity: the byte budget")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--kv-budget-tokens", type=int, default=6144,
                    help="kv-speed: the KV budget in bf16 tokens (64 x (128 + 64) = 12288 needed: bf16 retracts)")
    ap.add_argument("--itl-tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="table rows to leave out, comma-separated (e.g. 'int8 weights')")
    ap.add_argument("--workdir", help="where the re-quantized GGUFs go (default: a temporary directory)")
    ap.add_argument("--json", help="default: bench/results/quantization-<date>.json")
    args = ap.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    args.corpora = [c for c in args.corpora.split(",") if c]
    args.skip = {r.strip() for r in args.skip.split(",") if r.strip()}
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}: choose from {PARTS}")
    models = Models(args.workdir or tempfile.mkdtemp(prefix="radixmesh-quant-bench-"))
    result = {"date": datetime.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(),
              "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()}}
    runs = {"table": part_table, "capacity": part_capacity, "kv-speed": part_kv_speed, "weights": part_weights}
    for part in parts:
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        result[part] = runs[part](models, args)
        result[part]["seconds"] = time.perf_counter() - t0
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"quantization-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
