"""Speculative decoding, measured (issue 18), in one run; ratios against plain decoding and the peers.

Workload: bench/data/copy_heavy.json (quotes, code edits that repeat their input, multi-turn chats
that re-send their history), greedy, 128 new tokens, EOS honoured.

1. radixmesh single stream (`radixmesh up`, one request at a time, streamed): inter-token latency
   (decode time / (tokens - 1)) with speculation off, n-gram (NGRAM), and the draft-model drafter
   (STANDALONE, the default GGUF drafting for itself), with each drafter's acceptance length.
2. radixmesh at 64 concurrent requests: output tokens/s with adaptive n-gram speculation vs off.
3. the peers, each alone on the machine, single stream on the same workload: llama-server with its
   own speculation (its draft-model mode, the same GGUF drafting for itself; its lookup mode where
   the build has one), and vLLM's CPU backend with its n-gram speculation where it runs.

    .venv/bin/python bench/speculative.py [--skip-llama] [--skip-vllm] [--quick]
Prints the ratios and writes bench/results/speculative-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import peer_servers as peers  # noqa: E402  (the peer-launch code bench/peers.py shares)

WORKLOAD = json.load(open(os.path.join(REPO, "bench", "data", "copy_heavy.json")))
MAX_TOKENS = 128


def stream_one(url: str, model: str, messages: list[dict], extra: dict | None = None) -> dict:
    """One streamed greedy chat completion → first-token and last-token times, token count."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, last, usage, text = time.perf_counter(), None, None, None, ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    tokens = usage["completion_tokens"] if usage else None
    return {"ttft_s": (first - t0) if first else None, "decode_s": (last - first) if first else None,
            "tokens": tokens, "speculative": (usage or {}).get("speculative"), "text": text}


def single_stream(url: str, model: str, extra: dict | None = None) -> dict:
    stream_one(url, model, WORKLOAD[0]["messages"], extra)  # warm-up
    runs = [stream_one(url, model, c["messages"], extra) for c in WORKLOAD]
    itls = [r["decode_s"] / (r["tokens"] - 1) for r in runs if r["tokens"] and r["tokens"] > 1]
    spec = [r["speculative"] for r in runs if r["speculative"]]
    out = {"requests": len(runs), "output_tokens": sum(r["tokens"] or 0 for r in runs),
           "mean_itl_ms": round(1000 * statistics.mean(itls), 3),
           "median_itl_ms": round(1000 * statistics.median(itls), 3),
           "mean_ttft_ms": round(1000 * statistics.mean(r["ttft_s"] for r in runs if r["ttft_s"]), 2),
           "texts": [r["text"] for r in runs]}
    if spec:
        steps = sum(s["verify_steps"] for s in spec)
        out["accept_length"] = round(1 + sum(s["accepted_tokens"] for s in spec) / steps, 3) if steps else None
        out["acceptance_rate"] = round(sum(s["accepted_tokens"] for s in spec)
                                       / max(1, sum(s["draft_tokens"] for s in spec)), 3)
    return out


def concurrent(url: str, model: str, clients: int, requests: int) -> dict:
    jobs = [WORKLOAD[i % len(WORKLOAD)]["messages"] for i in range(requests)]

    def one(messages):
        body = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.load(r)["usage"]["completion_tokens"]

    one(jobs[0])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": requests, "output_tokens": tokens, "seconds": round(wall, 2),
            "output_tokens_per_s": round(tokens / wall, 2)}


def radixmesh(flags: list[str], clients: int = 0, requests: int = 0) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--max-connections-per-client",
           "none"] + flags
    out = {"command": "radixmesh " + shlex.join(cmd[4:])}
    with peers.Server(cmd, None) as server:
        model = json.load(urllib.request.urlopen(server.url + "/v1/models"))["data"][0]["id"]
        out["single_stream"] = single_stream(server.url, model)
        print(f"{out['command']}: single-stream ITL {out['single_stream']['mean_itl_ms']} ms, accept length "
              f"{out['single_stream'].get('accept_length')}", file=sys.stderr, flush=True)
        if clients:
            out["concurrent"] = concurrent(server.url, model, clients, requests)
            print(f"  {clients} clients: {out['concurrent']['output_tokens_per_s']} tok/s", file=sys.stderr, flush=True)
    return out


def llama(args, model_path: str, mode: str) -> dict:
    binary = peers.llama_binary(peers.llama_venv(args.cache_dir))
    if binary is None:
        return {"skipped": "llama-server is not built: run bench/peers.py once (it builds it)"}
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    if "--spec-type" not in help_text:
        return {"skipped": "this llama-server build has no --spec-type (speculative decoding) flag"}
    port = peers.free_port()
    cmd = peers.llama_server_command(binary, model_path, port, 1, 4096, args.threads, "on")
    if mode == "draft":  # the same GGUF drafting for itself, as radixmesh's STANDALONE run
        cmd += ["--spec-type", "draft-simple", "-md", model_path, "--spec-draft-n-max", "6"]
    else:  # prompt lookup with radixmesh's n-gram window (2) and depth (8)
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "8"]
    with peers.Server(cmd, f"http://127.0.0.1:{port}") as server:
        out = {"command": shlex.join(cmd), "single_stream": single_stream(server.url, "default")}
    print(f"llama-server {mode}: ITL {out['single_stream']['mean_itl_ms']} ms", file=sys.stderr, flush=True)
    return out


def vllm(args, speculative: bool) -> dict:
    exe = os.path.join(args.vllm_venv, "bin", "vllm")
    if not os.path.exists(exe):
        return {"skipped": "vLLM is not installed (bash bench/setup_vllm.sh)"}
    port = peers.free_port()
    extra = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 8,
                                                 "prompt_lookup_max": 8, "prompt_lookup_min": 2})] if speculative else []
    cmd = peers.vllm_command(exe, args.vllm_model, port, max_num_seqs=8, prefix_caching=None, extra=extra)
    try:
        with peers.Server(cmd, f"http://127.0.0.1:{port}", ready_timeout_s=900, env=peers.vllm_env()) as server:
            out = {"command": shlex.join(cmd), "single_stream": single_stream(server.url, peers.VLLM_MODEL_NAME)}
    except peers.ServerFailed as e:
        return {"command": shlex.join(cmd), "failed": str(e)[-1500:]}
    print(f"vLLM speculative={speculative}: ITL {out['single_stream']['mean_itl_ms']} ms", file=sys.stderr, flush=True)
    return out


def verify_step_costs(max_rows: int = 9) -> dict:
    """The one-call step's time by tokens in it (one request: [last, *draft]), in-process: what a
    verify item of d drafted tokens costs against a one-token step."""
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine
    from services.step.contract import NewRequestSpec, StepItem, StepPlan
    from services.worker.config import WorkerConfig
    engine = Engine(worker=WorkerConfig(kv_cache_bytes=64 << 20))
    try:
        runner, prompt = engine.runner, list(range(100, 400))
        runner.execute(StepPlan(1, [NewRequestSpec("a", prompt, [], SamplingParams(temperature=0), 1)],
                                [StepItem("a", prompt, 0, list(range(40)), True)]))
        out, step_id = {}, 2
        for rows in range(1, max_rows + 1):
            times = []
            for _ in range(15):
                item = StepItem("a", [5] + [7] * (rows - 1), len(prompt), [], False, verify=rows > 1)
                t0 = time.perf_counter()
                runner.compute_logits(StepPlan(step_id, [], [item]))
                times.append(time.perf_counter() - t0)
                step_id += 1
            out[rows] = round(1000 * statistics.median(times), 2)
        return {"step_ms_by_tokens": out, "relative": {r: round(t / out[1], 2) for r, t in out.items()}}
    finally:
        engine.shutdown()


def engine_breakdown() -> dict:
    """In-process, the workload one request at a time with n-gram speculation: the share of output
    tokens that came from verify items, and the worker's time per token in the steps that ran them."""
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine
    from services.worker.config import WorkerConfig
    engine = Engine(worker=WorkerConfig(kv_cache_bytes=256 << 20, speculative_algorithm="NGRAM"))
    try:
        sampling = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS)
        engine.generate(messages=WORKLOAD[0]["messages"], sampling=sampling)
        s = engine.scheduler.stats
        before = (s.steps, s.spec_steps, s.spec_verify_items, s.spec_accepted_tokens, s.verify_seconds)
        tokens = 0
        for conv in WORKLOAD:
            tokens += len(engine.generate(messages=conv["messages"], sampling=sampling).token_ids)
        verify_items = s.spec_verify_items - before[2]
        verify_tokens = verify_items + s.spec_accepted_tokens - before[3]
        return {"output_tokens": tokens, "tokens_from_verify_items": verify_tokens,
                "share_from_verify_items": round(verify_tokens / tokens, 3),
                "verify_ms_per_token": round(1000 * (s.verify_seconds - before[4]) / verify_tokens, 2)
                if verify_tokens else None, "steps": s.steps - before[0], "verify_steps": s.spec_steps - before[1]}
    finally:
        engine.shutdown()


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def itl(res: dict) -> float | None:
    return (res.get("single_stream") or {}).get("mean_itl_ms")


def summary(res: dict) -> dict:
    off, ngram, draft = res["off"], res["ngram"], res.get("standalone", {})
    s = {"n-gram single-stream ITL speedup (off / on)": ratio(itl(off), itl(ngram)),
         "n-gram accept length": ngram["single_stream"].get("accept_length"),
         "draft-model single-stream ITL speedup (off / on)": ratio(itl(off), itl(draft)),
         "draft-model accept length": (draft.get("single_stream") or {}).get("accept_length"),
         "64 clients tok/s, adaptive n-gram / off": ratio(ngram["concurrent"]["output_tokens_per_s"],
                                                          off["concurrent"]["output_tokens_per_s"]),
         "greedy texts identical, n-gram vs off": ngram["single_stream"]["texts"] == off["single_stream"]["texts"]}
    for name in ("llama_draft", "llama_lookup", "vllm_off", "vllm_ngram"):
        peer = res.get(name, {})
        s[f"{name} ITL / radixmesh n-gram ITL"] = ratio(itl(peer), itl(ngram)) if itl(peer) else (
            peer.get("skipped") or (peer.get("failed") or "")[:200] or None)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-standalone", action="store_true")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    ap.add_argument("--cache-dir", default="~/.cache/radixmesh/peers")
    ap.add_argument("--vllm-venv", default=os.path.expanduser("~/.cache/radixmesh/peers/vllm/venv"))
    ap.add_argument("--vllm-model", default=os.path.expanduser("~/.cache/radixmesh/peers/vllm/smollm2-hf"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--costs-only", action="store_true",
                    help="only the in-process parts: verify step cost by tokens, and where the tokens came from")
    args = ap.parse_args(argv)
    if args.costs_only:
        res = {"cpu": cpu_model(), "verify_step_costs": verify_step_costs(), "engine_breakdown": engine_breakdown()}
        print(json.dumps(res, indent=1))
        out = args.out or os.path.join(REPO, "bench", "results", f"speculative-costs-{time.strftime('%Y-%m-%d')}.json")
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    from services.common.model_path import default_model_path
    model_path = default_model_path()
    res = {"cpu": cpu_model(), "workload": "bench/data/copy_heavy.json",
           "max_tokens": MAX_TOKENS}
    res["off"] = radixmesh([], args.clients, args.requests)
    res["ngram"] = radixmesh(["--speculative-algorithm", "NGRAM"], args.clients, args.requests)
    if not args.skip_standalone:
        res["standalone"] = radixmesh(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                                       model_path])
    if not args.skip_llama:
        res["llama_draft"] = llama(args, model_path, "draft")
        res["llama_lookup"] = llama(args, model_path, "lookup")
    if not args.skip_vllm:
        res["vllm_off"] = vllm(args, False)
        res["vllm_ngram"] = vllm(args, True)
    res["summary"] = summary(res)
    print(json.dumps(res["summary"], indent=1))
    out = args.out or os.path.join(REPO, "bench", "results", f"speculative-{time.strftime('%Y-%m-%d')}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
