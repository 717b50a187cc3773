"""The client half of scripts/compose_check.sh: talks to a compose stack from the host, prints
one JSON line per call and exits 0 when the check holds.

    compose_probe.py chat URL                  a streamed chat completion (OpenAI SDK), with a
                                               traceparent whose trace id it reports
    compose_probe.py trace COLLECTOR TRACE_ID SERVICE...   that trace reached the collector
                                               from every SERVICE (radixmesh-<name>)
    compose_probe.py targets PROMETHEUS N      Prometheus scrapes N targets, every one up
    compose_probe.py replicas URL N            the gateway's router reports N replicas
    compose_probe.py load URL N MAX_TOKENS READY_FILE
                                               N concurrent streams; touches READY_FILE once each
                                               has its first token (the caller then stops the
                                               stack), then waits for every one to end: cleanly,
                                               with finish_reason length or abort, after the stop
                                               began (a load that ends first proves nothing)
    compose_probe.py cut URL MAX_TOKENS READY_FILE
                                               one stream; touches READY_FILE once it has its first
                                               token (the caller then kills a worker node), then
                                               waits for it to end: with an error, not a hang and
                                               not a clean finish (the group lost a node mid-stream)
    compose_probe.py ready URL WANT TIMEOUT_S  the gateway's /ready answers 200 (WANT=1) or not
                                               (WANT=0) within TIMEOUT_S; prints when it did
"""
from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from openai import AsyncOpenAI, OpenAI

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _until(check, timeout_s: float, every_s: float = 1.0):
    """check() until it returns something truthy or the time is up; its last answer (None when
    it never answered: refused connections and HTTP errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except OSError:  # urllib's URLError and HTTPError included
            got = None
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every_s)


def chat(url: str) -> bool:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    trace_id = secrets.token_hex(16)
    t0 = time.perf_counter()
    ttft, text, finish = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0, stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(choice.delta.content)
            finish = choice.finish_reason or finish
    total = time.perf_counter() - t0
    print(json.dumps({"model": model, "ttft_ms": round(ttft * 1e3, 1) if ttft else None,
                      "total_ms": round(total * 1e3, 1), "finish_reason": finish, "text": "".join(text),
                      "trace_id": trace_id}))
    return bool(text) and finish in ("length", "stop")


def trace(collector: str, trace_id: str, services: list[str]) -> bool:
    def seen():
        # a 404 until the first span arrives: the exporters batch for up to 5 s
        spans = _get(f"{collector}/api/traces/{trace_id}")["data"][0]["spans"]
        got = {s["service"] for s in spans}
        return (got, len(spans)) if set(services) <= got else None

    got = _until(seen, 30)
    ok = isinstance(got, tuple)
    print(json.dumps({"trace_id": trace_id, "services": sorted(got[0]) if ok else None,
                      "spans": got[1] if ok else 0, "all_services_seen": ok}))
    return ok


def targets(prometheus: str, n: int) -> bool:
    def scraped():
        active = _get(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
        ups = {t["labels"]["instance"]: t["health"] for t in active}
        return ups if len(ups) == n and all(h == "up" for h in ups.values()) else None

    got = _until(scraped, 60, 2)
    ok = isinstance(got, dict)
    if not ok:  # say which
        got = {t["labels"]["instance"]: f'{t["health"]} {t["lastError"]}'
               for t in _get(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]}
    print(json.dumps({"targets": got, "all_up": ok}))
    return ok


def replicas(url: str, n: int) -> bool:
    got = _get(f"{url}/admin/replicas")
    rows = got.get("replicas", got.get("data", []))
    print(json.dumps({"replicas": [r.get("address") for r in rows], "states": [r.get("state") for r in rows]}))
    return len(rows) == n


async def _load(url: str, n: int, max_tokens: int, ready: Path) -> bool:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    first = [asyncio.Event() for _ in range(n)]

    async def one(i: int) -> dict:
        t0, tokens, finish, done = time.perf_counter(), 0, None, False
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"{PROMPT} ({i})"}],
                max_tokens=max_tokens, temperature=0.8, seed=i, stream=True,
                extra_body={"ignore_eos": True})  # each runs until max_tokens, or until aborted
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        tokens += 1
                        first[i].set()
                    finish = choice.finish_reason or finish
            done = True  # the stream ended as SSE streams end: [DONE], then the connection
            error = None
        except Exception as e:  # a cut stream, a refused request
            error = f"{type(e).__name__}: {e}"
        first[i].set()
        return {"i": i, "finish_reason": finish, "chunks": tokens, "ended_cleanly": done, "error": error,
                "seconds": round(time.perf_counter() - t0, 2), "ended_at": time.perf_counter()}

    tasks = [asyncio.ensure_future(asyncio.wait_for(one(i), 240)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)
    ready.write_text("streaming\n")  # the check runs `compose stop` now
    stop_at = time.perf_counter()
    results = []
    for t in tasks:
        try:
            results.append(await t)
        except asyncio.TimeoutError:
            results.append({"finish_reason": None, "ended_cleanly": False, "error": "hung: no end after 240 s",
                            "ended_at": time.perf_counter()})
    clean = [r["ended_cleanly"] and r["finish_reason"] in ("length", "abort") for r in results]
    # a stream over before the stop says nothing about the stop: the load must outlast its start
    in_flight = sum(r["ended_at"] > stop_at for r in results)
    reasons = {}
    for r in results:
        reasons[str(r["finish_reason"])] = reasons.get(str(r["finish_reason"]), 0) + 1
    print(json.dumps({"streams": n, "in_flight_at_stop": in_flight, "finish_reasons": reasons,
                      "all_clean": all(clean), "longest_s": max(r.get("seconds", 0) for r in results),
                      "stream_ends_after_stop_s": sorted(round(r["ended_at"] - stop_at, 1) for r in results),
                      "failed": [{k: v for k, v in r.items() if k != "ended_at"}
                                 for r, ok in zip(results, clean) if not ok]}))
    return all(clean) and in_flight == n


def cut(url: str, max_tokens: int, ready_file: Path) -> bool:
    """A stream whose worker group loses a node while it runs must end with an error, soon."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chunks, finish, error = 0, None, None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    chunks += 1
                    if chunks == 1:
                        ready_file.write_text("streaming\n")  # the check kills the node now
                finish = choice.finish_reason or finish
    except Exception as e:  # the SSE error event, raised by the client; or a cut connection
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"chunks": chunks, "finish_reason": finish, "error": error and error[:300],
                      "ended_at_epoch": round(time.time(), 3)}))
    return chunks > 0 and error is not None and finish is None


def ready(url: str, want: bool, timeout_s: float) -> bool:
    """/ready is 200 when the gateway can serve (its tokenizer's Ready: scheduler, worker, detokenizer)."""
    def status() -> int:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0
    t0 = time.monotonic()
    got = _until(lambda: (status() == 200) == want, timeout_s, 0.25)
    print(json.dumps({"ready": want if got else not want, "after_s": round(time.monotonic() - t0, 2),
                      "ended_at_epoch": round(time.time(), 3)}))
    return bool(got)


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "chat":
        ok = chat(args[0])
    elif cmd == "trace":
        ok = trace(args[0], args[1], args[2:])
    elif cmd == "targets":
        ok = targets(args[0], int(args[1]))
    elif cmd == "replicas":
        ok = replicas(args[0], int(args[1]))
    elif cmd == "cut":
        ok = cut(args[0], int(args[1]), Path(args[2]))
    elif cmd == "ready":
        ok = ready(args[0], args[1] == "1", float(args[2]))
    elif cmd == "load":
        ok = asyncio.run(_load(args[0], int(args[1]), int(args[2]), Path(args[3])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
