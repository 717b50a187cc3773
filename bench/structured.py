"""Structured outputs, measured (issue 16): what a constraint costs, what jump-forward saves, and
how radixmesh's constrained serving compares with llama-server's and vLLM's, in one run.

1. radixmesh (`radixmesh up`): output tokens/s of the JSON-schema workload (the 28 prompts of
   bench/common/structured_cases.py, response_format json_schema, greedy) against the same prompts
   unconstrained, at 1 and 32 concurrent requests; and the share of constrained outputs that
   parse and validate.
2. jump-forward (in-process Engine): model steps per output token with and without it, one
   request at a time, on a schema with long fixed keys.
3. the peers, each alone on the machine after radixmesh stopped: llama-server (its json_schema
   -> GBNF path; the same GGUF) and, when installed (--vllm-venv), vLLM's CPU backend (xgrammar),
   on the same constrained workload at 32 concurrent: tokens/s and validity.

    .venv/bin/python bench/structured.py [--skip-llama] [--vllm-venv DIR --vllm-model HF_DIR]
(llama-server is built by bench/peers.py on its first run; vLLM is set up by bench/setup_vllm.sh.)
Prints the ratios and writes bench/results/structured-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import jsonschema  # noqa: E402

import peers  # noqa: E402
from bench.common.structured_cases import MAX_TOKENS, SCHEMA_CASES  # noqa: E402

LONG_KEYS = {"type": "object", "additionalProperties": False,
             "required": ["customer_full_name", "customer_account_identifier", "preferred_contact_method",
                          "is_premium_subscription_active"],
             "properties": {"customer_full_name": {"type": "string", "maxLength": 30},
                            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
                            "preferred_contact_method": {"enum": ["email", "phone"]},
                            "is_premium_subscription_active": {"type": "boolean"}}}
CUSTOMERS = ["Bob Smith, account 1234, email, premium", "Ann Lee, account 77, phone, not premium",
             "Carl Diaz, account 4051, email, not premium", "Dana Wu, account 9, phone, premium",
             "Eve Stone, account 3100, email, premium", "Fay Moss, account 65, phone, premium"]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def requests_for(concurrency: int) -> list[tuple[str, dict]]:
    cases = [(prompt, schema) for _, prompt, schema in SCHEMA_CASES]
    n = max(len(cases), 2 * concurrency)
    return [cases[i % len(cases)] for i in range(n)]


def run_workload(url: str, model: str, concurrency: int, constrained: bool,
                 lengths: list[int] | None = None) -> dict:
    """All requests with `concurrency` in flight → tokens/s, validity, errors. `lengths`: each
    request generates exactly that many tokens (ignore_eos): the free run matched to the
    constrained run's output lengths, so per-request costs (prefill, HTTP) weigh the same."""
    jobs = [(i, *job) for i, job in enumerate(requests_for(concurrency))]

    def one(job):
        i, prompt, schema = job
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": 0}
        if lengths is not None:
            body.update(max_tokens=max(lengths[i], 1), ignore_eos=True)
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": schema, "strict": True}}
        try:
            out = post(url, body)
        except urllib.error.HTTPError as e:
            return 0, False, f"{e.code}: {e.read()[:200]!r}"
        text = out["choices"][0]["message"]["content"] or ""
        if not constrained:
            return out["usage"]["completion_tokens"], False, None
        try:
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        return out["usage"]["completion_tokens"], valid, None

    post(url, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})  # warm
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    errors = [r[2] for r in results if r[2]]
    return {"concurrency": concurrency, "constrained": constrained, "requests": len(jobs), "seconds": round(wall, 2),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
            "lengths": [r[0] for r in results],
            "valid_rate": round(sum(r[1] for r in results) / len(results), 3), "errors": errors[:3],
            "error_count": len(errors)}


def radixmesh(args) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-port", "0"] + shlex.split(args.radixmesh_args)
    out = {"command": "radixmesh " + shlex.join(cmd[4:])}
    with peers.Server(cmd, None) as server:
        model = json.load(urllib.request.urlopen(server.url + "/v1/models"))["data"][0]["id"]
        # Cold: every schema compiles on first use (28 distinct schemas, each used once at 1 client);
        # then warm, as a service whose schemas repeat sees it: the grammars come from the cache.
        out["c1_constrained_cold"] = run_workload(server.url, model, 1, True)
        for c in (1, 32):
            out[f"c{c}_constrained"] = con = run_workload(server.url, model, c, True)
            out[f"c{c}_free"] = run_workload(server.url, model, c, False)
            out[f"c{c}_free_same_lengths"] = run_workload(server.url, model, c, False, con["lengths"])
            print(f"radixmesh c={c}: constrained {con['output_tokens_per_s']} tok/s (valid {con['valid_rate']}), "
                  f"free {out[f'c{c}_free']['output_tokens_per_s']}, free at the same lengths "
                  f"{out[f'c{c}_free_same_lengths']['output_tokens_per_s']}", file=sys.stderr, flush=True)
    return out


def jump_forward_steps() -> dict:
    """Model steps per output token and time, one request at a time: jump-forward off (the CPU
    default), on over every forced run (min 1), and only over runs of 8 or more tokens."""
    from services.common.grammar.constraint import json_schema
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine
    from services.worker.config import WorkerConfig
    out = {}
    for name, cfg in (("off", WorkerConfig(jump_forward=False)),
                      ("on_min1", WorkerConfig(jump_forward=True, jump_forward_min_tokens=1)),
                      ("on_min8", WorkerConfig(jump_forward=True, jump_forward_min_tokens=8))):
        engine = Engine(worker=cfg)
        try:
            engine.generate(messages=[{"role": "user", "content": "Hi"}], sampling=SamplingParams(
                max_new_tokens=4, constraint=json_schema(LONG_KEYS)))  # compile and warm outside the timing
            steps0, tokens, t0 = engine.scheduler.stats.steps, 0, time.perf_counter()
            for who in CUSTOMERS:
                res = engine.generate(messages=[{"role": "user", "content": f"Make a customer record: {who}."}],
                                      sampling=SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0,
                                                              constraint=json_schema(LONG_KEYS)))
                tokens += len(res.token_ids)
            steps = engine.scheduler.stats.steps - steps0
            out[name] = {"steps": steps, "output_tokens": tokens,
                                         "steps_per_token": round(steps / tokens, 3),
                                         "seconds": round(time.perf_counter() - t0, 2),
                                         "forced_tokens": engine.scheduler.stats.jump_forward_tokens}
        finally:
            engine.shutdown()
    return out


def llama(args, model_path: str) -> dict:
    binary = peers.llama_binary(peers.llama_venv(args.cache_dir))
    if binary is None:
        return {"skipped": "llama-server is not built: run bench/peers.py once (it builds it)"}
    port = peers.free_port()
    cmd = peers.llama_server_command(binary, model_path, port, 32, 1024, args.threads, "on") + ["-kvu"]
    with peers.Server(cmd, f"http://127.0.0.1:{port}") as server:
        return peer_runs("llama-server", server, "default")


def peer_runs(name: str, server: peers.Server, model: str) -> dict:
    """A peer's free and constrained runs at 32 clients, after a warm-up pass (as for radixmesh)."""
    out = {"command": shlex.join(server.cmd)}
    run_workload(server.url, model, 32, True)
    for constrained in (False, True):
        run = run_workload(server.url, model, 32, constrained)
        print(f"{name} c=32 constrained={constrained}: {run['output_tokens_per_s']} tok/s, "
              f"valid {run['valid_rate']}, errors {run['error_count']}", file=sys.stderr, flush=True)
        out[f"c32_{'constrained' if constrained else 'free'}"] = run
    return out


def vllm(args) -> dict:
    if not args.vllm_venv or not os.path.exists(os.path.join(args.vllm_venv, "bin", "vllm")):
        return {"skipped": "vLLM is not installed (--vllm-venv DIR with its CPU backend; shared/PEERS.md)"}
    port = peers.free_port()
    cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", args.vllm_model, "--dtype", "bfloat16",
           "--max-model-len", "4096", "--max-num-seqs", "64", "--enable-prefix-caching", "--served-model-name",
           "smollm2", "--port", str(port), "--host", "127.0.0.1"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    with peers.Server(cmd, f"http://127.0.0.1:{port}", ready_timeout_s=600) as server:
        return peer_runs("vLLM", server, "smollm2")


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def summary(res: dict) -> dict:
    rm, jf = res["radixmesh"], res["jump_forward"]
    s = {}
    for c in (1, 32):
        con = rm[f"c{c}_constrained"]["output_tokens_per_s"]
        s[f"radixmesh constrained/free tok/s at {c}, same lengths"] = ratio(
            con, rm[f"c{c}_free_same_lengths"]["output_tokens_per_s"])
        s[f"radixmesh constrained/free tok/s at {c}, free runs on"] = ratio(con, rm[f"c{c}_free"]["output_tokens_per_s"])
    s["radixmesh constrained tok/s at 1, cold/warm grammar cache"] = ratio(
        rm["c1_constrained_cold"]["output_tokens_per_s"], rm["c1_constrained"]["output_tokens_per_s"])
    s["radixmesh constrained valid rate"] = rm["c32_constrained"]["valid_rate"]
    for name in [k for k in jf if k != "off"]:
        s[f"jump-forward {name}/off steps per token"] = ratio(jf[name]["steps_per_token"], jf["off"]["steps_per_token"])
        s[f"jump-forward {name}/off time"] = ratio(jf[name]["seconds"], jf["off"]["seconds"])
    for peer in ("llama-server", "vllm"):
        p = res.get(peer, {})
        if "c32_constrained" in p:
            s[f"radixmesh/{peer} constrained tok/s at 32"] = ratio(rm["c32_constrained"]["output_tokens_per_s"],
                                                                  p["c32_constrained"]["output_tokens_per_s"])
            s[f"{peer} constrained valid rate"] = p["c32_constrained"]["valid_rate"]
            s[f"{peer} constrained/free tok/s at 32"] = ratio(p["c32_constrained"]["output_tokens_per_s"],
                                                              p["c32_free"]["output_tokens_per_s"])
        else:
            s[peer] = p.get("skipped", "not run")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--radixmesh-args", default="", help="extra flags for `radixmesh up`")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    ap.add_argument("--cache-dir", default="~/.cache/radixmesh/peers", help="where bench/peers.py built llama-server")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--vllm-venv", default=os.path.expanduser("~/.cache/radixmesh/peers/vllm/venv"))
    ap.add_argument("--vllm-model", default=os.path.expanduser("~/.cache/radixmesh/peers/vllm/smollm2-hf"),
                    help="an HF directory of the default model (shared/PEERS.md says how to write one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from services.common.model_path import default_model_path
    res = {"date": time.strftime("%Y-%m-%d"), "machine": peers.machine()}
    res["radixmesh"] = radixmesh(args)
    res["jump_forward"] = jump_forward_steps()
    res["llama-server"] = {"skipped": "--skip-llama"} if args.skip_llama else llama(args, default_model_path())
    res["vllm"] = vllm(args)
    res["summary"] = summary(res)
    out = args.out or os.path.join(REPO, "bench", "results", f"structured-{res['date']}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
