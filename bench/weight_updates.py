"""Weight updates on the default model (issue 20), one run: what each path costs, and the cost
framed as the seed frames it: sync time as a tax on an RL loop's iteration.

The paths, through the Engine's model administration (services/scheduler/model_admin.py: admission
paused, the worker swaps between two steps, every KV tier keyed on the old version flushed):
  disk-gguf     update_weights_from_disk(the default GGUF file itself)
  disk-hf       update_weights_from_disk(an HF safetensors directory of the same weights, bfloat16)
  tensor        update_weights_from_tensor(a /dev/shm safetensors file a trainer wrote)
  distributed   update_weights_from_distributed(a trainer process broadcasting over gloo)
Each runs twice (the first reads cold files); the report splits load, validate + swap, pause
and flush.

The tax: a rollout (N requests sharing an S-token system prompt, O output tokens each) takes R
seconds here; an update of U seconds costs U / (R + U) of the loop. The flush's own cost: the
shared prompt is prefilled again after the update, so the first request's time to first token
with the prompt cached is set against the same request right after an update.

    .venv/bin/python bench/weight_updates.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from services.common.model_path import default_model_path  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.weight_sync import remove_shared_tensors, tensor_metas, write_shared_tensors  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.tokenizer.text_tokenizer import load_tokenizer  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.loader.checkpoint import load_checkpoint  # noqa: E402

TRAINER = r"""
import sys
from safetensors.torch import load_file
from services.common.weight_sync import WeightBroadcaster
port, path = int(sys.argv[1]), sys.argv[2]
items = list(load_file(path).items())
sync = WeightBroadcaster("127.0.0.1", port, world_size=2, group_name="weights", timeout_s=120)
sync.broadcast(items)
sync.close()
"""


def hf_checkpoint(path: str, out: str) -> str:
    """The GGUF's weights as an HF safetensors directory (bfloat16): config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}, os.path.join(out, "model.safetensors"))
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed(engine: Engine, tensors_file: str):
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), tensors_file],
                               env={**os.environ, "PYTHONPATH": REPO})
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2)
        metas = [(m.name, m.dtype, m.shape) for m in tensor_metas(load_file(tensors_file))]
        return engine.update_weights_from_distributed(metas)
    finally:
        trainer.wait(timeout=300)


def rollout(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, float]:
    """All at once → (seconds, time to first token of the first request)."""
    sinks = [queue.SimpleQueue() for _ in prompts]
    t0 = time.perf_counter()
    for ids, q in zip(prompts, sinks):
        engine.submit(ids, sp, lambda c, q=q: q.put((time.perf_counter(), c)))
    first = None
    for q in sinks:
        while True:
            t, chunk = q.get()
            if chunk.error:
                raise RuntimeError(chunk.error)
            first = first if first is not None else t - t0
            if chunk.finished:
                break
    return time.perf_counter() - t0, first


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """(time to first token, cached prompt tokens) of one request alone."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.perf_counter()
    engine.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=1), lambda c: q.put((time.perf_counter(), c)))
    t, chunk = q.get()
    while not chunk.finished:
        _, chunk = q.get()
    return t - t0, chunk.cached_tokens


def report(state) -> dict:
    u = state.update
    return {"version": state.weights_version, "bytes": u.bytes, "load_s": u.load_seconds, "swap_s": u.swap_seconds,
            "pause_s": u.pause_seconds, "flush_s": u.flush_seconds, "flushed_pages": u.flushed_pages,
            "total_s": u.total_seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    path = default_model_path()
    tmp = tempfile.mkdtemp(prefix="radixmesh-weights-bench-")
    hf_dir = hf_checkpoint(path, tmp)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    engine = Engine(worker=WorkerConfig(max_requests=args.requests),
                    scheduler=SchedulerConfig(max_running_requests=args.requests),
                    checkpoint=load_checkpoint(path), tokenizer=load_tokenizer(path))
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(args.system_tokens)]
    prompts = [system + [rng.randrange(100, 49000) for _ in range(args.question_tokens)]
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.output_tokens, ignore_eos=True)
    paths = {
        "disk-gguf": lambda: engine.update_weights_from_disk(path),
        "disk-hf": lambda: engine.update_weights_from_disk(hf_dir),
        "tensor": lambda: _tensor(engine, tensors),
        "distributed": lambda: distributed(engine, os.path.join(hf_dir, "model.safetensors")),
    }
    results: dict = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                     "dtype": engine.runner.config.resolved_dtype, "paths": {}}
    try:
        rollout(engine, prompts[:4], sp)  # warm-up
        results["rollout_s"], _ = rollout(engine, prompts, sp)
        for name, update in paths.items():
            runs = []
            for _ in range(2):
                cached_ttft, cached = ttft(engine, prompts[0])
                state = update()
                after_ttft, after_cached = ttft(engine, prompts[0])
                runs.append({**report(state), "ttft_cached_s": cached_ttft, "cached_tokens": cached,
                             "ttft_after_s": after_ttft, "cached_tokens_after": after_cached})
            results["paths"][name] = runs
    finally:
        engine.shutdown()

    r = results["rollout_s"]
    print(f"rollout: {args.requests} requests x ({args.system_tokens} shared + {args.question_tokens}) prompt "
          f"+ {args.output_tokens} output tokens = {r:.2f} s ({results['dtype']})")
    print(f"{'path':12s} {'MB':>6s} {'load':>7s} {'swap':>7s} {'pause':>7s} {'flush':>7s} {'total':>7s} "
          f"{'tax':>6s}  TTFT cached -> after (cached tokens)")
    for name, runs in results["paths"].items():
        for i, x in enumerate(runs):
            x["tax"] = x["total_s"] / (r + x["total_s"])
            print(f"{name + (' (cold)' if i == 0 else ''):12s} {x['bytes'] / 1e6:6.0f} {x['load_s']:7.3f} "
                  f"{x['swap_s']:7.3f} {x['pause_s']:7.3f} {x['flush_s']:7.4f} {x['total_s']:7.3f} "
                  f"{100 * x['tax']:5.1f}%  {1e3 * x['ttft_cached_s']:.0f} ms ({x['cached_tokens']}) -> "
                  f"{1e3 * x['ttft_after_s']:.0f} ms ({x['cached_tokens_after']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _tensor(engine: Engine, tensors: dict[str, torch.Tensor]):
    shm = write_shared_tensors(tensors)
    try:
        return engine.update_weights_from_tensor(shm)
    finally:
        remove_shared_tensors(shm)


if __name__ == "__main__":
    sys.exit(main())
