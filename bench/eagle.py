"""EAGLE-3 speculative decoding, measured (issue 39), in one run: single-stream ITL and acceptance
length against plain decoding, through the mesh (`radixmesh up`, streamed chat completions, one
request at a time, greedy, 128 new tokens, EOS honoured).

Workloads:
- copy-heavy: bench/data/copy_heavy.json (quotes, code edits that repeat their input, multi-turn
  chats that re-send their history), where n-gram lookup already helps;
- chat: the held-out split of the head's prompt set (services/worker/speculative/data/
  draft_prompts.json, never trained on): ordinary questions, code, lists, rewriting.

Configurations, each workload on its own mesh, run back to back: plain decoding; EAGLE3 with the head shipped for
the default model, as a chain (the default flags) and as a tree (--speculative-eagle-topk 2); and
n-gram (NGRAM) for reference.

    .venv/bin/python bench/eagle.py [--quick] [--configs plain,chain,tree,ngram] [--head DIR]
Prints a table with each configuration's ITL over plain's and writes bench/results/eagle-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import peer_servers as peers  # noqa: E402
import speculative as spec_bench  # noqa: E402  (stream_one: one streamed greedy completion, timed)

COPY_HEAVY = [c["messages"] for c in json.load(open(os.path.join(REPO, "bench", "data", "copy_heavy.json")))]
PROMPTS = json.load(open(os.path.join(REPO, "services", "worker", "speculative", "data", "draft_prompts.json")))
CHAT = [p["messages"] for p in PROMPTS["prompts"] if p["split"] == "heldout"]

CONFIGS = {
    "plain": [],
    "chain": ["--speculative-algorithm", "EAGLE3"],
    "tree": ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "2",
             "--speculative-num-draft-tokens", "8"],
    "ngram": ["--speculative-algorithm", "NGRAM"],
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def workload_stats(url: str, model: str, conversations: list[list[dict]]) -> dict:
    """Each conversation once, one at a time → ITL (decode time / (tokens - 1)) and acceptance."""
    spec_bench.stream_one(url, model, conversations[0])  # warm-up
    runs = [spec_bench.stream_one(url, model, messages) for messages in conversations]
    itls = [r["decode_s"] / (r["tokens"] - 1) for r in runs if r["tokens"] and r["tokens"] > 1]
    counters = [r["speculative"] for r in runs if r["speculative"]]
    out = {"requests": len(runs), "output_tokens": sum(r["tokens"] or 0 for r in runs),
           "mean_itl_ms": round(1000 * statistics.mean(itls), 3),
           "median_itl_ms": round(1000 * statistics.median(itls), 3),
           "texts": [r["text"] for r in runs]}
    steps = sum(c["verify_steps"] for c in counters)
    if steps:
        out["accept_length"] = round(1 + sum(c["accepted_tokens"] for c in counters) / steps, 3)
        out["acceptance_rate"] = round(sum(c["accepted_tokens"] for c in counters)
                                       / max(1, sum(c["draft_tokens"] for c in counters)), 3)
    return out


def run_config(name: str, workloads: dict[str, list], head: str | None = None) -> dict:
    """Each workload on a mesh of its own: the scheduler's acceptance prior, which sets how deep
    it drafts, starts afresh for each (one workload's rejections do not silence the next)."""
    flags = CONFIGS[name] + (["--speculative-draft-model-path", head] if head and name in ("chain", "tree") else [])
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--max-connections-per-client",
           "none"] + flags
    out = {"flags": flags}
    for wl, conversations in workloads.items():
        with peers.Server(cmd, None) as server:
            model = json.load(urllib.request.urlopen(server.url + "/v1/models"))["data"][0]["id"]
            out[wl] = workload_stats(server.url, model, conversations)
        print(f"{name:6s} {wl:10s} ITL {out[wl]['mean_itl_ms']:7.2f} ms  accept length "
              f"{out[wl].get('accept_length')}", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 conversations per workload")
    ap.add_argument("--configs", default="plain,chain,tree,ngram")
    ap.add_argument("--head", help="an EAGLE-3 head directory for chain and tree (default: the shipped head)")
    ap.add_argument("--tag", default="", help="appended to the result file's name (a leading dash: --tag=-zen3)")
    args = ap.parse_args()
    n = 4 if args.quick else 12
    workloads = {"copy_heavy": COPY_HEAVY[:n], "chat": CHAT[:n]}
    names = args.configs.split(",")
    if names[0] != "plain":
        ap.error("--configs must start with plain (the ratios' base)")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "cores": os.cpu_count(),
              "head": args.head or "shipped",
              "max_tokens": spec_bench.MAX_TOKENS, "configs": {}}
    for name in names:
        result["configs"][name] = run_config(name, workloads, args.head)
    plain = result["configs"]["plain"]
    print(f"\nCPU: {result['cpu']} ({result['cores']} cores); single stream through the mesh, greedy, "
          f"{spec_bench.MAX_TOKENS} new tokens")
    print(f"{'config':8s} {'workload':11s} {'ITL ms':>8s} {'x plain':>8s} {'accept len':>11s} {'same text':>10s}")
    for name in names:
        for wl in workloads:
            r = result["configs"][name][wl]
            r["itl_vs_plain"] = round(r["mean_itl_ms"] / plain[wl]["mean_itl_ms"], 3)
            r["same_text_as_plain"] = r["texts"] == plain[wl]["texts"]
            print(f"{name:8s} {wl:11s} {r['mean_itl_ms']:8.2f} {r['itl_vs_plain']:8.3f} "
                  f"{str(r.get('accept_length', '-')):>11s} {str(r['same_text_as_plain']):>10s}")
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    path = os.path.join(REPO, "bench", "results", f"eagle-{time.strftime('%Y-%m-%d')}{args.tag}.json")
    for cfg in result["configs"].values():
        for wl in workloads:
            cfg[wl].pop("texts")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
