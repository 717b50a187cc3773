"""Multi-LoRA serving on the default model (issue 20), one run, printed as ratios.

Workload: N requests (P-token prompts of ordinary vocabulary ids, O output tokens, eos ignored)
submitted at once to the in-process Engine, served three ways in the same run:
  base     every request on the base model;
  one      every request under one adapter;
  mixed    request i under adapter i mod A (A adapters, all resident: --max-loras A);
  one_torch, mixed_torch  the same on stacked.py's torch paths (LoraManager.set_fused_kernel(False)),
           the baseline of the fused kernel (kernels/lora_cpu.py) that the other two run on.
The adapters are random PEFT adapters (bench/common/random_adapter.py) of rank R on all
seven target modules. Each mode runs twice, alternating, and the better run counts.

Per step (the better run's): the median forward time of the full-batch decode steps (N rows of
one token), and the forward time of the steps that carry prompt tokens per 1,024 of their tokens.

Adapter load latency: cold = LoadLoraAdapter of an adapter the worker has not seen (its files
read, checked and kept on the host); warm = bringing a host-loaded adapter back into a slot
after the LRU evicted it (what a step pays before it runs the adapter's first request).

    .venv/bin/python bench/lora.py [--requests 64] [--adapters 8] [--rank 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common.random_adapter import make_random_adapter  # noqa: E402
from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.tokenizer.text_tokenizer import load_tokenizer  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402


def hf_model_for_shapes(path: str):
    """transformers' model of the GGUF: only its module names and shapes are used."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32)


def record_steps(engine: Engine) -> list[tuple[list[int], float]]:
    """From now on, every step's (tokens per item, forward seconds), appended to the list returned."""
    log: list[tuple[list[int], float]] = []
    execute = engine.runner.execute

    def timed(plan):
        result = execute(plan)
        log.append(([len(item.input_ids) for item in plan.items], result.forward_seconds))
        return result

    engine.runner.execute = timed
    return log


def step_times(log: list[tuple[list[int], float]], n: int) -> dict[str, float]:
    """→ decode_ms: median of the steps of n one-token items; prefill_ms_per_1024: the steps
    with a prompt chunk, their seconds per 1,024 of their tokens."""
    decode = sorted(s for rows, s in log if len(rows) == n and max(rows) == 1)
    prefill = [(sum(rows), s) for rows, s in log if rows and max(rows) > 1]
    tokens = sum(t for t, _ in prefill)
    return {"decode_ms": decode[len(decode) // 2] * 1e3 if decode else float("nan"),
            "prefill_ms_per_1024": sum(s for _, s in prefill) / tokens * 1024e3 if tokens else float("nan")}


def run(engine: Engine, prompts: list[list[int]], adapters: list[str], sp: SamplingParams) -> float:
    """Submit all at once → output tokens per second."""
    sinks = [queue.SimpleQueue() for _ in prompts]
    t0 = time.perf_counter()
    for ids, adapter, q in zip(prompts, adapters, sinks):
        engine.submit(ids, sp, q.put, adapter=adapter)
    tokens = 0
    for q in sinks:
        while True:
            chunk = q.get()
            if chunk.error:
                raise RuntimeError(chunk.error)
            tokens += len(chunk.token_ids)
            if chunk.finished:
                break
    return tokens / (time.perf_counter() - t0)


def load_latency(engine: Engine, path: str, name: str) -> tuple[float, float]:
    """(cold: LoadLoraAdapter of unseen files, warm: a host-loaded adapter back into a slot), seconds."""
    t0 = time.perf_counter()
    engine.load_lora_adapter(name, path)
    cold = time.perf_counter() - t0
    loras = engine.runner.loras  # the engine is idle: no step runs while this measures
    for slot, resident in enumerate(loras.slots):
        if resident == name:
            loras.slots[slot] = None
    with torch.inference_mode():  # as on the step thread
        t0 = time.perf_counter()
        loras.batch([(name, 1)])
        warm = time.perf_counter() - t0
    return cold, warm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    path = default_model_path()
    checkpoint, tokenizer = load_checkpoint(path), load_tokenizer(path)
    tmp = tempfile.mkdtemp(prefix="radixmesh-lora-bench-")
    hf = hf_model_for_shapes(path)
    names = [f"a{i}" for i in range(args.adapters)]
    dirs = {n: make_random_adapter(hf, os.path.join(tmp, n), args.rank, 2 * args.rank, seed=i)
            for i, n in enumerate(names + ["late"])}
    del hf
    n = args.requests
    worker = WorkerConfig(max_requests=n, max_loras=args.adapters,
                          lora_paths=tuple(f"{a}={dirs[a]}" for a in names))
    engine = Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=n), checkpoint=checkpoint,
                    tokenizer=tokenizer)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_tokens)] for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.output_tokens, ignore_eos=True)
    one, mixed = [names[0]] * n, [names[i % len(names)] for i in range(n)]
    modes = {"base": [""] * n, "one": one, "mixed": mixed, "one_torch": one, "mixed_torch": mixed}
    log = record_steps(engine)
    try:
        for fused in (False, True):  # warm-up: every code path once
            engine.runner.loras.set_fused_kernel(fused)
            run(engine, prompts[:8], modes["mixed"][:8], sp)
        best = {m: 0.0 for m in modes}
        steps: dict[str, dict[str, float]] = {}
        for _ in range(2):
            for mode, adapters in modes.items():
                engine.runner.loras.set_fused_kernel(not mode.endswith("_torch"))  # between runs: no step in flight
                log.clear()
                tps = run(engine, prompts, adapters, sp)
                if tps > best[mode]:
                    best[mode], steps[mode] = tps, step_times(log, n)
                print(f"  {mode}: {best[mode]:.1f} tok/s so far", flush=True)
        engine.runner.loras.set_fused_kernel(True)
        cold, warm = load_latency(engine, dirs["late"], "late")
    finally:
        engine.shutdown()

    result = {
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "dtype": worker.resolved_dtype, "requests": n, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "adapters": args.adapters, "rank": args.rank,
        "tok_s": best, "mixed_vs_base": best["mixed"] / best["base"], "one_vs_base": best["one"] / best["base"],
        "mixed_vs_torch_path": best["mixed"] / best["mixed_torch"], "one_vs_torch_path": best["one"] / best["one_torch"],
        "steps": steps,
        "load_cold_ms": cold * 1e3, "load_warm_ms": warm * 1e3,
    }
    print(f"{n} requests x {args.prompt_tokens}+{args.output_tokens} tokens, {worker.resolved_dtype}, "
          f"{args.adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down")
    for mode, tps in best.items():
        st = steps[mode]
        print(f"  {mode:11s} {tps:8.1f} output tok/s  ({tps / best['base']:.3f}x base)   decode step "
              f"{st['decode_ms']:.1f} ms, prefill {st['prefill_ms_per_1024']:.0f} ms per 1,024 tokens")
    print(f"fused kernel vs torch paths: one {result['one_vs_torch_path']:.2f}x, mixed {result['mixed_vs_torch_path']:.2f}x")
    print(f"mixed {args.adapters} adapters vs base-only: {result['mixed_vs_base']:.3f}x (target >= 0.7x)")
    print(f"adapter load: cold {result['load_cold_ms']:.1f} ms (files → host), "
          f"warm {result['load_warm_ms']:.2f} ms (host → slot)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
