"""A tree-of-thought program through radixmesh.lang (fork: the root prefilled once, branches in
parallel) against the same /generate calls made naively one by one, on a running gateway.

    make serve &   # or: radixmesh up --http-port 8000
    flock /tmp/bench.lock .venv/bin/python bench/frontend.py --url http://127.0.0.1:8000

Prints, for each, wall time and the share of prompt tokens served from the prefix cache. Each
variant gets its own root text (a nonce), so neither finds the other's prefix cached."""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixmesh.lang import HttpBackend, assistant, function, gen, system, user  # noqa: E402

CONTEXT = ("You are a careful planner. Think about the problem from several angles, name the trade-offs, "
           "and keep every idea short and concrete. ") * 6
QUESTION = "How should a small team cut the cost of serving a language model without hurting latency?"


@function
def tree_of_thought(s, nonce, width, depth_tokens):
    s += system(f"[{nonce}] " + CONTEXT)
    s += user(QUESTION)
    ideas = s.fork(width)
    for i, f in enumerate(ideas):
        f += assistant(f"Idea {i + 1}:", gen("idea", max_tokens=depth_tokens))
    ideas.join()
    s.meta["calls"] = [f.get_meta_info("idea") for f in ideas]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def naive(url: str, backend: HttpBackend, nonce: str, width: int, depth_tokens: int) -> list[dict]:
    fmt = backend.role_format()
    root = (fmt.begin("system") + f"[{nonce}] " + CONTEXT + fmt.end("system") + fmt.begin("user") + QUESTION
            + fmt.end("user"))
    return [_post(url, {"text": root + fmt.begin("assistant") + f"Idea {i + 1}:",
                        "sampling_params": {"max_new_tokens": depth_tokens, "temperature": 0}})["meta_info"]
            for i in range(width)]


def _share(metas: list[dict]) -> float:
    return sum(m["cached_tokens"] for m in metas) / max(1, sum(m["prompt_tokens"] for m in metas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    backend = HttpBackend(args.url)
    backend.role_format()  # learnt once, outside the timings
    t0 = time.monotonic()
    metas = naive(args.url, backend, uuid.uuid4().hex[:8], args.width, args.tokens)
    naive_s = time.monotonic() - t0
    t0 = time.monotonic()
    state = tree_of_thought.run(nonce=uuid.uuid4().hex[:8], width=args.width, depth_tokens=args.tokens,
                                backend=backend)
    lang_s = time.monotonic() - t0
    print(f"{'variant':<28} {'wall s':>8} {'cached share':>13}")
    print(f"{'naive, one by one':<28} {naive_s:>8.2f} {_share(metas):>13.1%}")
    print(f"{'radixmesh.lang fork':<28} {lang_s:>8.2f} {_share(state.meta['calls']):>13.1%}")


if __name__ == "__main__":
    main()
