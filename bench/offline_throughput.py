"""Offline throughput and prefix-cache TTFT of the in-process Engine, each
against its peer measured in the same run.

Workload 1: N requests (P-token prompts, O output tokens, eos ignored) through
the Engine vs transformers `generate` with static batches of 16.
Workload 2: M requests sharing an S-token prefix (plus a Q-token question),
arriving together: mean time to first token with the prefix cache on vs off.

    .venv/bin/python bench/offline_throughput.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.tokenizer.text_tokenizer import load_tokenizer  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402


def random_prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    # Ordinary vocabulary ids: skip the special tokens at the start of SmolLM2's vocabulary.
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def run_engine(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, list[float]]:
    """Submit all at once; returns (seconds, time to first token of each)."""
    sinks = [queue.SimpleQueue() for _ in prompts]
    t0 = time.perf_counter()
    for ids, q in zip(prompts, sinks):
        engine.submit(ids, sp, lambda c, q=q: q.put((time.perf_counter(), c)))
    ttft, tokens = [], 0
    for q in sinks:
        first = None
        while True:
            t, chunk = q.get()
            if chunk.error:
                raise RuntimeError(chunk.error)
            if first is None and chunk.token_ids:
                first = t - t0
            tokens += len(chunk.token_ids)
            if chunk.finished:
                break
        ttft.append(first)
    return time.perf_counter() - t0, ttft


def engine_throughput(args, ckpt, tok, prompts, dtype: str) -> dict:
    worker = WorkerConfig(dtype=dtype, max_requests=args.max_running)
    engine = Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=args.max_running),
                    checkpoint=ckpt, tokenizer=tok)
    sp = SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True)
    run_engine(engine, prompts[:2], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up
    s0 = engine.scheduler.stats.schedule_seconds
    f0 = time.perf_counter()
    seconds, _ = run_engine(engine, prompts, sp)
    sched = engine.scheduler.stats.schedule_seconds - s0
    engine.shutdown()
    out_tokens = len(prompts) * args.output_len
    return {"seconds": seconds, "output_tok_s": out_tokens / seconds,
            "scheduler_share": sched / (time.perf_counter() - f0)}


@torch.inference_mode()
def hf_throughput(args, prompts) -> dict:
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=2)
    model.generate(torch.tensor(prompts[:2]), max_new_tokens=4, do_sample=False, pad_token_id=2)  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch = torch.tensor(prompts[i:i + args.hf_batch])
        out = model.generate(batch, attention_mask=torch.ones_like(batch), **gen)
        assert out.shape[1] == batch.shape[1] + args.output_len
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "output_tok_s": len(prompts) * args.output_len / seconds}


def prefix_ttft(args, ckpt, tok, cache_on: bool, rng: random.Random) -> dict:
    prefix = random_prompts(1, args.prefix_len, rng)[0]
    prompts = [prefix + q for q in random_prompts(args.prefix_requests, args.question_len, rng)]
    engine = Engine(worker=WorkerConfig(dtype=args.dtype, max_requests=args.max_running),
                    scheduler=SchedulerConfig(max_running_requests=args.max_running,
                                              disable_radix_cache=not cache_on),
                    checkpoint=ckpt, tokenizer=tok)
    run_engine(engine, random_prompts(1, 16, rng), SamplingParams(temperature=0, max_new_tokens=2))
    seconds, ttft = run_engine(engine, prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    hit = engine.scheduler.stats.cache_hit_rate
    engine.shutdown()
    return {"mean_ttft_s": sum(ttft) / len(ttft), "max_ttft_s": max(ttft), "seconds": seconds, "hit_rate": hit}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--dtypes", default="float32,bfloat16", help="engine weight/KV dtypes to measure")
    p.add_argument("--dtype", default="float32", help="dtype of the prefix-cache TTFT runs")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    rng = random.Random(0)
    ckpt, tok = load_checkpoint(default_model_path()), load_tokenizer(default_model_path())
    prompts = random_prompts(args.num_requests, args.input_len, rng)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} cores", "torch_threads": torch.get_num_threads(), "args": vars(args)}
    for dtype in args.dtypes.split(","):
        r = results[f"engine_{dtype}"] = engine_throughput(args, ckpt, tok, prompts, dtype)
        print(f"engine {dtype:9s} {r['output_tok_s']:8.1f} output tok/s "
              f"(scheduler {100 * r['scheduler_share']:.2f}% of wall time)", flush=True)
    if not args.skip_hf:
        hf = results["hf_static"] = hf_throughput(args, prompts)
        print(f"hf float32 static batch {args.hf_batch}: {hf['output_tok_s']:8.1f} output tok/s")
        for dtype in args.dtypes.split(","):
            ratio = results[f"engine_{dtype}"]["output_tok_s"] / hf["output_tok_s"]
            results[f"throughput_ratio_{dtype}"] = ratio
            print(f"ratio engine {dtype} / hf float32 static: {ratio:.2f}x  (target >= 3x)", flush=True)
    on = prefix_ttft(args, ckpt, tok, True, random.Random(1))
    off = prefix_ttft(args, ckpt, tok, False, random.Random(1))
    results["prefix_cache_on"], results["prefix_cache_off"] = on, off
    results["ttft_ratio"] = on["mean_ttft_s"] / off["mean_ttft_s"]
    print(f"shared prefix mean TTFT: cache on {on['mean_ttft_s']:.2f}s (hit rate {on['hit_rate']:.2f}), "
          f"off {off['mean_ttft_s']:.2f}s, ratio {results['ttft_ratio']:.3f}  (target <= 0.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
