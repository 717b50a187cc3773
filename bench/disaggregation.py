"""The seed's PD benchmark (§4.7): the inter-token latency of running streams while long prompts
arrive, co-located against prefill/decode disaggregation, with the same cores in both.

- **co-located**: one replica (`radixmesh up`) on every CPU given (--cpus, default "0,1").
- **PD**: a prefill replica pinned to the first CPU and a decode replica pinned to the rest
  (`taskset`), the pairing sent to both tokenizers as the router sends it (grpc transfer backend
  unless --transfer-backend says otherwise).

Workload, the same for both: --streams requests (short random prompts, --stream-tokens output
tokens, greedy, ignore_eos) start together; once each has produced its first token, --long
prompts of --long-len random token ids (4 output tokens each) arrive --long-gap-s apart. The
streams' ITL (gaps between consecutive token events of one stream) is collected while the long
prompts are in flight; p50, p99 and max are printed per mode, with the long prompts' TTFT and the
streams' mean ITL outside that window. All at the defaults of `radixmesh up` (bfloat16 where the
CPU has it, 1,024-token prefill chunks). Random ordinary-vocabulary token ids: no prefix hits.

    .venv/bin/python bench/disaggregation.py [--cpus 0,1] [--streams 4] [--long 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protos.radixmesh.v1 import common_pb2, tokenizer_pb2  # noqa: E402
from services.loadgen.metrics import percentile  # noqa: E402
from services.router.pairing import side_request  # noqa: E402  (the sides of a pair, as the router sends them)
from services.router.roles import DECODE, PREFILL  # noqa: E402
from tests.integration.mesh_harness import Mesh  # noqa: E402  (launches `radixmesh up`, reads its addresses)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def generate(ids: list[int], max_new: int) -> tokenizer_pb2.GenerateTextRequest:
    return tokenizer_pb2.GenerateTextRequest(
        rid=uuid.uuid4().hex, input_ids=tokenizer_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))


class Deployment:
    """Where a request goes: one replica, or a prefill/decode pair."""

    def __init__(self, colocated: Mesh | None = None, prefill: Mesh | None = None, decode: Mesh | None = None):
        self.colocated, self.prefill, self.decode = colocated, prefill, decode
        self.bootstrap = ""
        if prefill is not None:
            self.bootstrap = prefill.tokenizer().Info(tokenizer_pb2.InfoRequest(), timeout=10).bootstrap_address

    def live(self, req: tokenizer_pb2.GenerateTextRequest):
        """Send; yield the arrival time of each event of the client's stream that carries tokens
        (a pair's prefill side is read to its end on a thread of its own)."""
        if self.colocated is not None:
            yield from _live(self.colocated.tokenizer().Generate(req, timeout=600))
            return
        room = uuid.uuid4().hex
        to_prefill = side_request(req, req.rid, PREFILL, room)
        to_decode = side_request(req, req.rid, DECODE, room, self.bootstrap)
        drain = threading.Thread(target=lambda: list(_live(self.prefill.tokenizer().Generate(to_prefill, timeout=600))))
        drain.start()
        yield from _live(self.decode.tokenizer().Generate(to_decode, timeout=600))
        drain.join()


def _live(call):
    for event in call:
        kind = event.WhichOneof("event")
        if kind == "error":
            raise RuntimeError(f"request failed: {event.error.message}")
        if kind == "chunk" and event.chunk.token_ids:
            yield time.perf_counter()


def run_workload(deploy: Deployment, args, seed: int) -> dict:
    rng = random.Random(seed)
    streams: list[list[float]] = [[] for _ in range(args.streams)]
    started = threading.Barrier(args.streams + 1)
    threads = []
    for i in range(args.streams):
        req = generate(prompt_ids(rng, 32), args.stream_tokens)

        def one(i=i, req=req):
            first = True
            for t in deploy.live(req):
                streams[i].append(t)
                if first:
                    first = False
                    started.wait(timeout=300)
        threads.append(threading.Thread(target=one))
    for t in threads:
        t.start()
    started.wait(timeout=300)
    window_start = time.perf_counter()
    long_ttft = []
    long_threads = []
    for k in range(args.long):
        req = generate(prompt_ids(rng, args.long_len), 4)

        def long_one(req=req):
            t0 = time.perf_counter()
            times = list(deploy.live(req))
            long_ttft.append(times[0] - t0)
        th = threading.Thread(target=long_one)
        th.start()
        long_threads.append(th)
        time.sleep(args.long_gap_s)
    for th in long_threads:
        th.join()
    window_end = time.perf_counter()
    for t in threads:
        t.join()
    inside, outside = [], []
    for times in streams:
        for a, b in zip(times, times[1:]):
            (inside if window_start <= b <= window_end else outside).append(b - a)
    return {
        "itl_in_window_ms": {"p50": 1e3 * percentile(inside, 50), "p99": 1e3 * percentile(inside, 99),
                             "max": 1e3 * max(inside) if inside else float("nan"), "n": len(inside)},
        "itl_outside_mean_ms": 1e3 * sum(outside) / len(outside) if outside else float("nan"),
        "long_ttft_s": {"mean": sum(long_ttft) / len(long_ttft), "max": max(long_ttft)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default="0,1", help="the CPUs both deployments use (PD: prefill on the first)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-gap-s", type=float, default=1.5)
    ap.add_argument("--transfer-backend", default="grpc", choices=("grpc", "shm", "mooncake"))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    cpus = args.cpus.split(",")
    if len(cpus) < 2:
        ap.error("--cpus needs at least two CPUs (one for prefill, the rest for decode)")
    print(f"CPU: {cpu_model()}; CPUs used: {args.cpus}; {args.streams} streams of {args.stream_tokens} tokens; "
          f"{args.long} prompts of {args.long_len} tokens {args.long_gap_s:g}s apart")
    results = {}
    colocated = Mesh("--max-running-requests", "16", cpus=args.cpus).wait_ready()
    try:
        results["co-located"] = run_workload(Deployment(colocated=colocated), args, seed=1)
    finally:
        colocated.stop()
    pd_flags = ["--max-running-requests", "16", "--disaggregation-transfer-backend", args.transfer_backend]
    prefill = Mesh(*pd_flags, "--disaggregation-mode", "prefill", cpus=cpus[0])
    decode = Mesh(*pd_flags, "--disaggregation-mode", "decode", cpus=",".join(cpus[1:]))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        results["PD"] = run_workload(Deployment(prefill=prefill, decode=decode), args, seed=1)
    finally:
        prefill.stop()
        decode.stop()
    print(f"{'mode':<12}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}{'ITL calm ms':>13}"
          f"{'long TTFT s':>13}")
    for mode, r in results.items():
        w = r["itl_in_window_ms"]
        print(f"{mode:<12}{w['p50']:>12.1f}{w['p99']:>12.1f}{w['max']:>12.1f}{r['itl_outside_mean_ms']:>13.1f}"
              f"{r['long_ttft_s']['mean']:>13.2f}")
    ratio = results["PD"]["itl_in_window_ms"]["p99"] / results["co-located"]["itl_in_window_ms"]["p99"]
    print(f"p99 ITL while long prompts arrive, PD / co-located: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "results": results, "p99_ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
