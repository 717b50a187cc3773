"""Expert parallelism on a MoE model whose prompts drive a few experts hot: EPLB's imbalance gauge
and step time before and after a rebalance, and the share of all-to-all time two-batch overlap
hides, all in one run (services/worker/parallel/expert_parallel.py, expert_rebalance.py).

The model is a random Qwen3-MoE built here (transformers), made skewed on purpose: every
embedding row shares one direction v, and the router rows of HOT experts lean along v, so those
experts win most tokens in every layer. With the spread placement (expert e in slot e) they all
sit on rank 0, which computes most rows while rank 1 waits at the all-to-all.

1. EP 2 (TP 2 attention), --ep-num-redundant-experts R: the workload (a batch of prompts, prefill
   then decode), step time and the imbalance gauge (max over mean tokens per rank, mean over layers).
2. A rebalance (EPLB from the loads just recorded; every rank, between steps): one run of the
   workload while its layers move (one per forward pass), then the workload again: the gauge and
   the step time, and the longest pause one layer's move added to a step.
3. Two-batch overlap: the same workload on groups started with that placement
   (--init-expert-location, the recording dumped from phase 1), TBO off, then on; rank 0's time
   waiting for the all-to-alls with each; hidden share = 1 - waiting(on) / waiting(off).

    flock /tmp/bench.lock .venv/bin/python bench/moe.py
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from tests.unit.tiny_models import word_tokenizer  # noqa: E402

HOT = (2, 3, 4)  # all on rank 0 under the spread placement


def build_model(path: Path, experts: int, hidden: int, intermediate: int, layers: int, lean: float) -> None:
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=intermediate, max_position_embeddings=1024)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    v = torch.nn.functional.normalize(torch.randn(hidden), dim=0)  # [hidden]
    with torch.no_grad():
        model.model.embed_tokens.weight += 0.2 * v
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight  # [E, hidden]
            gate[list(HOT)] += lean * v
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(str(path), config.vocab_size)  # the Engine wants one; the workload sends token ids


def workload(prompts: int, length: int, new_tokens: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (length,), generator=g).tolist() for _ in range(prompts)]


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for the batch, all submitted at once."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    began = time.perf_counter()
    outs = engine.generate_batch(prompts, sp)
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return time.perf_counter() - began


def on_step_thread(engine: Engine, fn):
    """fn() between two steps, on the thread that runs them (the worker group's collectives)."""
    return engine._executor.submit(fn).result()


def engine(path: Path, **flags) -> Engine:
    return Engine(str(path), worker=WorkerConfig(dtype="float32", kv_cache_bytes=64 << 20, max_requests=16,
                                                 tp_size=2, ep_size=2, **flags))


def steps(eng: Engine) -> int:
    return eng.runner.expert_load.total.forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lean", type=float, default=6.0, help="how hard the HOT experts' router rows lean along v")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# bench/moe.py on {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    build_model(tmp, args.experts, args.hidden, args.intermediate, args.layers, args.lean)
    prompts = workload(args.prompts, args.prompt_len, args.new_tokens, 1)
    print(f"# Qwen3-MoE {args.layers} layers, {args.experts} experts (top 2, I={args.intermediate}, H={args.hidden}), "
          f"hot experts {HOT}; EP 2 + {args.redundant} redundant; {args.prompts} prompts x {args.prompt_len} tokens "
          f"+ {args.new_tokens} new, best of {args.repeats}")

    eng = engine(tmp, ep_num_redundant_experts=args.redundant)
    try:
        run(eng, workload(2, 16, 2, 9), 2)  # warm-up
        on_step_thread(eng, eng.runner.expert_load.start)  # the leader's recording (the dump below)
        rebalancer = eng.runner.expert_parallel.rebalancer
        n0 = steps(eng)
        before_s = min(run(eng, prompts, args.new_tokens) for _ in range(args.repeats))
        per_pass = (steps(eng) - n0) // args.repeats
        gauge_before = rebalancer.imbalance()
        dump = on_step_thread(eng, eng.runner.expert_load.dump)
        record = on_step_thread(eng, eng.runner.rebalance_experts)
        n1, moving_s = steps(eng), 0.0
        while rebalancer.moving:  # its weights move over the next passes
            moving_s += run(eng, prompts, args.new_tokens)
        moving_passes = steps(eng) - n1  # its window restarted when the last layer moved, on every rank
        after_s = min(run(eng, prompts, args.new_tokens) for _ in range(args.repeats))
        gauge_after = rebalancer.imbalance()
    finally:
        eng.shutdown()
    print("\n## EPLB: one rebalance between two runs of the workload (same group)")
    print("| | imbalance (max/mean tokens per rank) | workload s | ms per step |")
    print("|---|---|---|---|")
    print(f"| spread placement | {gauge_before:.3f} | {before_s:.3f} | {1e3 * before_s / per_pass:.1f} |")
    print(f"| after EPLB | {gauge_after:.3f} | {after_s:.3f} | {1e3 * after_s / per_pass:.1f} |")
    print(f"| while moving (2 weights per pass) | | {moving_s:.3f} ({moving_passes} passes) | "
          f"{1e3 * moving_s / moving_passes:.1f} |")
    step_ms = 1e3 * before_s / per_pass
    print(f"rebalance: {record['layers']} layers moved in {record['seconds'] * 1e3:.1f} ms, {record['moved']} expert "
          f"weights received by rank 0; longest pause {record['longest_pause_s'] * 1e3:.1f} ms = "
          f"{record['longest_pause_s'] * 1e3 / step_ms:.2f} of a mean step (plan {record['plan_ms']} ms, then per "
          f"pass {record['pauses_ms']} ms); step time after/before {after_s / before_s:.2f}x")

    placement = tmp / "expert-loads.json"
    placement.write_text(dump.to_json())
    waits = {}
    for tbo in (False, True):
        eng = engine(tmp, ep_num_redundant_experts=args.redundant, init_expert_location=str(placement),
                     enable_two_batch_overlap=tbo)
        try:
            run(eng, workload(2, 16, 2, 9), 2)
            times = eng.runner.expert_parallel.times
            best = None
            for _ in range(args.repeats):
                w0, t0 = times.waiting_s, times.total_s
                s = run(eng, prompts, args.new_tokens)
                sample = (s, times.waiting_s - w0, times.total_s - t0)
                best = sample if best is None or s < best[0] else best
            waits[tbo] = best
        finally:
            eng.shutdown()
    print("\n## Two-batch overlap (balanced placement from --init-expert-location), rank 0")
    print("| TBO | workload s | all-to-all waiting s | MoE dispatch s |")
    print("|---|---|---|---|")
    for tbo, (s, wait, total) in waits.items():
        print(f"| {'on' if tbo else 'off'} | {s:.3f} | {wait:.3f} | {total:.3f} |")
    hidden = 1 - waits[True][1] / waits[False][1] if waits[False][1] else float("nan")
    print(f"hidden share of all-to-all time: {hidden:.2f}; workload on/off {waits[True][0] / waits[False][0]:.2f}x")
    print(json.dumps({"imbalance_before": gauge_before, "imbalance_after": gauge_after, "before_s": before_s,
                      "after_s": after_s, "tbo_hidden_share": hidden}))


if __name__ == "__main__":
    main()
