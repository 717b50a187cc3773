"""Where a worker step's time goes: one decode (or prefill) step of the real
ModelRunner, timed whole and broken down by torch's profiler.

    .venv/bin/python bench/step_profile.py [--dtype bfloat16] [--batch 64] [--kv-len 320]
                                           [--prefill-len 0] [--backend cpu] [--no-decode-stack]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.step.contract import NewRequestSpec, StepItem, StepPlan  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402


def decode_plan(runner: ModelRunner, batch: int, kv_len: int, step_id: int) -> StepPlan:
    """`batch` requests holding kv_len tokens each, one new token each (pages pre-assigned)."""
    plan = StepPlan(step_id=step_id)
    per_request = -(-(kv_len + 1) // runner.kv_spec.page_size)
    for b in range(batch):
        rid = f"r{b}"
        pages = list(range(b * per_request, (b + 1) * per_request))
        if rid not in runner.requests:
            plan.new_requests.append(NewRequestSpec(rid, [1] * kv_len, [], SamplingParams(temperature=0), 0))
            plan.items.append(StepItem(rid, [7], kv_len, pages, reset_pages=True))
        else:
            plan.items.append(StepItem(rid, [7], kv_len, []))
    return plan


def prefill_plan(batch: int, length: int, step_id: int, page_size: int = 1) -> StepPlan:
    plan = StepPlan(step_id=step_id)
    per_request = -(-length // page_size)
    for b in range(batch):
        rid = f"p{step_id}-{b}"
        plan.new_requests.append(NewRequestSpec(rid, [5] * length, [], SamplingParams(temperature=0), 0))
        plan.items.append(StepItem(rid, [5 + (i % 50) for i in range(length)], 0,
                                   list(range(b * per_request, (b + 1) * per_request)), reset_pages=True))
        plan.released_rids.append(f"p{step_id - 1}-{b}")
    return plan


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kv-len", type=int, default=320)
    p.add_argument("--prefill-len", type=int, default=0, help="time a prefill of this many tokens per request instead")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quant-max-rows", type=int, default=WorkerConfig.quant_max_rows,
                   help="steps of at most this many tokens use the file's quantized weights (0: never)")
    p.add_argument("--decode-stack", action=argparse.BooleanOptionalAction, default=WorkerConfig.decode_stack,
                   help="small decode steps as one C++ call (--no-decode-stack: op by op)")
    p.add_argument("--trace", action="store_true", help="print the profiler's op table")
    args = p.parse_args()
    if os.environ.get("FLUSH_DENORMAL"):
        torch.set_flush_denormal(True)
    ckpt = load_checkpoint(default_model_path())
    runner = ModelRunner(WorkerConfig(dtype=args.dtype, attention_backend=args.backend, max_requests=max(64, args.batch),
                                      kv_cache_bytes=1 << 30, page_size=args.page_size,
                                      quant_max_rows=args.quant_max_rows, decode_stack=args.decode_stack), ckpt)

    def plan(i: int) -> StepPlan:
        if args.prefill_len:
            return prefill_plan(args.batch, args.prefill_len, i, runner.kv_spec.page_size)
        return decode_plan(runner, args.batch, args.kv_len, i)

    for i in range(3):
        runner.execute(plan(i))
    times = []
    for i in range(3, 3 + args.steps):
        t0 = time.perf_counter()
        runner.execute(plan(i))
        times.append(time.perf_counter() - t0)
    best = min(times)
    tokens = args.batch * (args.prefill_len or 1)
    print(f"{args.dtype} {args.backend} B={args.batch} {'prefill ' + str(args.prefill_len) if args.prefill_len else 'decode kv ' + str(args.kv_len)}: "
          f"best {best * 1e3:.1f} ms, median {sorted(times)[len(times) // 2] * 1e3:.1f} ms, {tokens / best:.0f} tok/s")
    if args.trace:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(100, 103):
                runner.execute(plan(i))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
