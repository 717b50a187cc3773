"""A multi-tenant workload over a fleet of replicas: cache_aware vs round_robin, in one run.

    .venv/bin/python bench/router_fleet.py                       # 8 tenants, 200 requests, 2 replicas
    .venv/bin/python bench/router_fleet.py --requests 80 --rate 1 # a smaller run

Each tenant has its own ~1,000-token system prompt; each request is that prompt plus a
short distinct question, greedy, --max-tokens new tokens, arriving as a Poisson process
(--rate requests/s, seeded: both policies get the same arrivals and prompts). For each
policy the script starts `radixmesh up --replicas N --no-gateway --policy P` afresh (empty
caches), replays the workload against the router over gRPC, and reads the fleet's
prefix-cache hit rate from the replicas' own counters (GetLoad: cached / looked-up prompt
tokens). The KV pool per replica (--kv-tokens) is sized to hold about half the tenants'
prompts, as in a fleet whose cache is the scarce resource: routing decides whether a
replica keeps its tenants' prefixes or churns through all of them.
Prints hit rate, output throughput, mean/p99 TTFT per policy and the ratios; writes
bench/results/router_fleet.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from protos.radixmesh.v1 import common_pb2, tokenizer_pb2 as pb, tokenizer_pb2_grpc  # noqa: E402

KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M in bfloat16: K and V, 30 layers, 3 KV heads of 64
WORDS = ("bread oven flour yeast crust dough rye wheat bakery order delivery price allergy gluten sugar butter "
         "morning weekend holiday invoice customer account refund receipt shelf storage label policy supplier "
         "schedule staff counter window payment discount membership question answer polite short").split()


def tenant_prompts(tenants: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"You are the assistant of tenant {t}. Rules and knowledge base follow. "
            + " ".join(rng.choice(WORDS) for _ in range(words)) for t in range(tenants)]


def workload(args) -> list[tuple[float, int, str]]:
    """(arrival offset s, tenant, question), Poisson arrivals."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        out.append((t, tenant, f"Question {i}: what about {rng.choice(WORDS)} on day {rng.randrange(365)}?"))
    return out


class Fleet:
    """`radixmesh up --replicas N --no-gateway` in a subprocess; `ready` gives the addresses."""

    def __init__(self, args, policy: str) -> None:
        argv = [sys.executable, "-m", "services.cli", "up", "--no-gateway", "--replicas", str(args.replicas),
                "--policy", policy, "--kv-cache-bytes", str(args.kv_tokens * KV_BYTES_PER_TOKEN),
                "--max-running-requests", str(args.max_running), "--drain-timeout-s", "5", "--dtype", "bfloat16",
                # routing alone: a shared kvstore would give round_robin the prefixes too (issue 7)
                "--no-kvstore"]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.ready = threading.Event()
        self.addresses: dict[str, str] = {}
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(900):
            self.stop()
            raise RuntimeError("the fleet did not start:\n" + "".join(self.tail[-20:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.tail = (self.tail + [line])[-50:]
            if '"ready"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("service") == "launcher" and event.get("msg") == "ready":
                    self.addresses = event["addresses"]
                    self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def one(stub, system: str, question: str, max_tokens: int, t0: float) -> dict:
    conv = pb.Conversation(messages=[pb.ChatMessage(role="system", content=system),
                                     pb.ChatMessage(role="user", content=question)])
    request = pb.GenerateTextRequest(conversation=conv, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))
    start, first, tokens, prompt, cached = time.perf_counter(), None, 0, 0, 0
    async for event in stub.Generate(request, timeout=1800):
        kind = event.WhichOneof("event")
        if kind == "chunk":
            first = first or time.perf_counter()
            tokens = event.chunk.completion_tokens
            prompt, cached = event.chunk.prompt_tokens, event.chunk.cached_tokens
        elif kind == "error":
            raise RuntimeError(event.error.message)
    return {"start": start - t0, "ttft": first - start, "end": time.perf_counter() - t0, "tokens": tokens,
            "prompt": prompt, "cached": cached}


async def replay(fleet: Fleet, args, prompts: list[str], plan: list[tuple[float, int, str]]) -> dict:
    async with grpc.aio.insecure_channel(fleet.addresses["router"]) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        t0 = time.perf_counter()

        async def at(offset: float, tenant: int, question: str) -> dict:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            return await one(stub, prompts[tenant], question, args.max_tokens, t0)

        results = await asyncio.gather(*(at(*item) for item in plan))
    hit = query = 0
    for name, address in fleet.addresses.items():
        if name.startswith("tokenizer"):
            async with grpc.aio.insecure_channel(address) as ch:
                load = await tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
            hit, query = hit + load.cache_hit_tokens, query + load.cache_query_tokens
    ttfts = sorted(r["ttft"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"hit_rate": hit / query if query else 0.0,
            "request_hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            "output_tok_s": sum(r["tokens"] for r in results) / span, "span_s": span,
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "mean_prompt_tokens": statistics.fmean(r["prompt"] for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=950, help="~1,000 tokens with the default model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=6000, help="KV pool per replica, in tokens")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "router_fleet.json"))
    args = parser.parse_args()

    prompts, plan = tenant_prompts(args.tenants, args.system_words, args.seed), workload(args)
    results = {}
    for policy in args.policies:
        fleet = Fleet(args, policy)
        try:
            print(f"{policy}: fleet up, replaying {len(plan)} requests over {plan[-1][0]:.0f} s ...", flush=True)
            results[policy] = asyncio.run(replay(fleet, args, prompts, plan))
        finally:
            fleet.stop()
        r = results[policy]
        print(f"  {policy:12s} hit rate {r['hit_rate']:.3f}  output {r['output_tok_s']:.1f} tok/s  "
              f"TTFT mean {r['ttft_mean_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s  "
              f"(prompt {r['mean_prompt_tokens']:.0f} tokens)", flush=True)
    ratios = {}
    if {"cache_aware", "round_robin"} <= set(results):
        ca, rr = results["cache_aware"], results["round_robin"]
        ratios = {"throughput": ca["output_tok_s"] / rr["output_tok_s"],
                  "ttft_mean": ca["ttft_mean_s"] / rr["ttft_mean_s"], "ttft_p99": ca["ttft_p99_s"] / rr["ttft_p99_s"]}
        met = ca["hit_rate"] >= 0.8 and (ratios["throughput"] >= 1.3 or ratios["ttft_mean"] <= 0.7)
        print(f"cache_aware / round_robin: throughput {ratios['throughput']:.2f}x, TTFT mean "
              f"{ratios['ttft_mean']:.2f}x, p99 {ratios['ttft_p99']:.2f}x; target (hit >= 0.8 and >= 1.3x "
              f"throughput or <= 0.7x TTFT) {'met' if met else 'NOT met'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
