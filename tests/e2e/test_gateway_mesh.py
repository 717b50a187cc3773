"""The HTTP API of the real mesh: `radixmesh up` (gateway on a free port) in a
subprocess, driven with the official `openai` client and raw HTTP.

One mesh per module. Greedy parity with the in-process Engine runs one request
at a time with both prefix caches flushed first, so both sides compute the same
batches. The scheduler's stats (KV pages, aborts) come from its GetStats RPC at
the address the launcher's `ready` line reports.
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

import services.launcher.up  # noqa: E402,F401 (the launcher the tests drive)

from protos.radixmesh.v1 import scheduler_pb2  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from tests.integration.mesh_harness import REPO, Mesh, stats  # noqa: E402

# ~5.5k tokens of KV; 40 running requests so 32 clients decode together (the worker's rows
# above that: with rows == max running, a full batch has failed a step); a short waiting
# queue so that a flood meets RESOURCE_EXHAUSTED; the context capped at 1024 tokens so that
# a prompt that nearly fills it stays cheap on a CPU.
CONTEXT = 1024
MESH_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(256 << 20), "--max-requests", "48", "--max-running-requests", "40",
              "--max-queued-requests", "40", "--context-length", str(CONTEXT), "--check-invariants"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "Water boils at",
           "The largest planet in the solar system is", "My favourite programming language is"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in one sentence."},
          {"role": "user", "content": "Why is the sky blue?"}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(checkpoint, tokenizer) -> dict:
    """Greedy outputs of the in-process Engine: ('text'|'chat', i) → RequestOutput (joined)."""
    engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=64 << 20, max_requests=8),
                    scheduler=SchedulerConfig(max_running_requests=8), checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        out = {}
        sp = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
        for i, p in enumerate(PROMPTS):
            engine.scheduler.kv.cache.reset()
            out["text", i] = engine.generate(p, sp, timeout=120)
        for i, m in enumerate(CHATS):
            engine.scheduler.kv.cache.reset()
            out["chat", i] = engine.generate(messages=m, sampling=sp, timeout=120)
        return out
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def mesh(expected):
    m = Mesh(*MESH_FLAGS, gateway=True)
    try:
        m.wait_ready()
        listening = next(e for e in m.log if e.get("service") == "gateway" and e.get("msg") == "listening")
        m.url = f"http://127.0.0.1:{listening['http_port']}"
        assert listening["http_port"] > 0 and listening["url"] == m.url
        deadline = time.monotonic() + 10  # --http-port 0: the launcher prints the port the gateway bound
        while not any(line.startswith(f"radixmesh is up: {m.url};") for line in m.stdout):
            assert time.monotonic() < deadline, m.stdout
            time.sleep(0.05)
        yield m
        assert m.stop() == 0
        assert m.leftover_children() == []
    finally:
        m.kill_all()


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    (m,) = client.models.list().data
    return m.id


def flush(mesh: Mesh) -> None:
    """Empty the prefix cache, once the previous requests are gone (a request cut by a
    stop string may still be ending in the scheduler when its HTTP response is complete)."""
    settle(mesh)
    resp = mesh.scheduler().FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=10)
    assert resp.flushed, resp.message


def in_use(s) -> int:
    """KV pages held by requests (the prefix cache's own pages excluded)."""
    return s.kv_pages_used - s.kv_pages_cached


def settle(mesh: Mesh, timeout: float = 20):
    """The scheduler's stats once nothing runs and no request holds KV (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(mesh)
        if (s.num_running == 0 and s.num_waiting == 0 and in_use(s) == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def http(mesh: Mesh, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(mesh.url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


@pytest.mark.parametrize("i", range(len(PROMPTS[:3])))
def test_completion_matches_the_engine(mesh, client, model, expected, i):
    want = expected["text", i]
    flush(mesh)
    whole = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    assert whole.usage.total_tokens == want.prompt_tokens + want.completion_tokens
    flush(mesh)
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == want.completion_tokens


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_matches_the_engine(mesh, client, model, expected, i):
    want = expected["chat", i]
    flush(mesh)
    whole = client.chat.completions.create(model=model, messages=CHATS[i], max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == want.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    flush(mesh)
    chunks = list(client.chat.completions.create(model=model, messages=CHATS[i], max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_repeated_prompt_reports_cached_tokens(client, model):
    prompt = "Caching check: " + " ".join(PROMPTS)
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens is not None
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True).close()
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_n_logprobs_and_stop_through_the_mesh(client, model):
    out = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=6, n=2, seed=3,
                                         temperature=0.8, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    assert all(len(t.top_logprobs) == 2 for c in out.choices for t in c.logprobs.content)
    # Token strings, as OpenAI reports them: each token's own text and its share of the UTF-8
    # bytes (a piece of a character, such as half of "ê", reads bytes:\xNN).
    for c in out.choices:
        tokens = c.logprobs.content
        for t in [*tokens, *(top for tok in tokens for top in tok.top_logprobs)]:
            assert t.token == bytes(t.bytes).decode(errors="ignore") or t.token.startswith("bytes:\\x"), t
        if c.finish_reason == "length":  # no EOS among them: the tokens spell the text
            assert bytes(b for t in tokens for b in t.bytes).decode() == c.message.content
    greedy = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert len(greedy.logprobs.tokens) == 4 and "".join(greedy.logprobs.tokens) == greedy.text
    assert [list(top) for top in greedy.logprobs.top_logprobs] == [[t] for t in greedy.logprobs.tokens]
    free = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0).choices[0]
    stop = free.text.strip().split()[1]
    cut = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.text.startswith(cut.text)


async def test_32_concurrent_streams_all_complete(mesh, model, expected):
    flush(mesh)

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None]:
        p = i % len(PROMPTS)
        stream = await c.completions.create(model=model, prompt=PROMPTS[p], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return p, text, reason

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=500) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = await all_of_them()
    assert len(results) == 32
    for p, text, reason in results:
        assert text == expected["text", p].text, PROMPTS[p]
        assert reason == expected["text", p].finish_reason
    s = settle(mesh)
    assert s.num_running == 0 and in_use(s) == 0


def test_no_max_tokens_fills_what_the_context_leaves(mesh, client, model):
    """OpenAI's default max_tokens: a prompt 100 tokens short of the context, no max_tokens,
    runs until the context is full (not a 400 for prompt + a fixed default)."""
    status, _, models = http(mesh, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["max_model_len"] == CONTEXT
    ids = list(range(1000, 1000 + CONTEXT - 100))  # ordinary vocabulary ids
    out = client.completions.create(model=model, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (CONTEXT - 100, 100)
    plain = client.completions.create(model=model, prompt=ids, temperature=0)  # EOS may end it sooner
    assert plain.choices[0].finish_reason in ("length", "stop") and plain.usage.completion_tokens <= 100
    chat = client.chat.completions.create(model=model, messages=CHATS[0], temperature=0)
    assert chat.choices[0].finish_reason == "stop" and "Paris" in chat.choices[0].message.content


KILLED_CLIENT = """
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
for chunk in c.completions.create(model=sys.argv[2], prompt="Count slowly:", max_tokens=900, stream=True,
                                  extra_body={"ignore_eos": True}):
    print(repr(chunk.choices[0].text), flush=True)
"""


def test_a_killed_streaming_client_frees_its_kv(mesh, model):
    before = stats(mesh)
    assert before.num_running == 0
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, mesh.url, model], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # it is streaming
            assert client.stdout.readline()
        assert stats(mesh).num_running == 1 and in_use(stats(mesh)) > 0
        client.send_signal(signal.SIGKILL)
        client.wait()
        s = settle(mesh)
        assert (s.num_running, in_use(s)) == (0, in_use(before))
        assert s.aborted == before.aborted + 1
    finally:
        client.kill()


BAD = [
    ("POST", "/v1/completions", b"{oops", 400, "not valid JSON"),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, 400, "does not exist"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400,
     "temperature must be in [0, 2]"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "prompt must be"),
    ("POST", "/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 10}, 400, "context length"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400,
     "leaves no room for the prompt"),
    ("POST", "/v1/completions", {"prompt": [10 ** 6]}, 400, "outside the vocabulary"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 400,
     "echo and prompt_logprobs are not supported with stream"),
    ("POST", "/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one of text and input_ids"),
    ("GET", "/v1/nothing-here", None, 404, "unknown route"),
]


@pytest.mark.parametrize("method,path,body,status,message", BAD, ids=[b[4] for b in BAD])
def test_bad_input_gets_its_status_and_the_mesh_keeps_serving(mesh, client, model, method, path, body, status,
                                                              message):
    if isinstance(body, dict) and path.startswith("/v1/"):
        body = {"model": model, **body}
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    got, _, out = http(mesh, method, path, raw)
    assert got == status and message in out["error"]["message"], out
    assert client.completions.create(model=model, prompt="ok", max_tokens=1).choices[0].finish_reason == "length"


async def test_a_full_queue_is_a_503_with_retry_after(mesh, model):
    async def flood():
        body = {"model": model, "prompt": " ".join(PROMPTS), "max_tokens": 4, "temperature": 0}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one():
                async with s.post(mesh.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()
            return await asyncio.gather(*(one() for _ in range(160)))

    results = await flood()
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503}
    refused = [r for r in results if r[0] == 503]
    assert refused, "the flood never filled the queue"
    assert all(r[1] and r[2]["error"]["code"] == "resource_exhausted" for r in refused)
    await asyncio.sleep(0.5)
    assert http(mesh, "GET", "/ready")[0] == 200


def test_fuzz_the_real_mesh(mesh):
    import schemathesis
    from schemathesis import GenerationMode

    from tests.unit.test_gateway_fuzz import fuzz

    doc = http(mesh, "GET", "/openapi.json")[2]
    schema = schemathesis.openapi.from_dict(doc)
    for result in schema.get_all_operations():
        op = result.ok()
        # A POST that takes no parameters (no body, or {}: /flush_cache) has no invalid request to send:
        # schemathesis marks the valid empty POST as "schema-violating", which a mesh rightly accepts.
        # The gateway's own fuzz test (tests/unit/test_gateway_fuzz.py) covers those routes.
        if op.method.upper() == "POST" and not takes_parameters(doc, op.path):
            continue
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            fuzz(mesh.url, op, mode, max_examples=8, prepare=small_generation)
    s = settle(mesh)
    assert s.num_running == 0 and in_use(s) == 0


def takes_parameters(doc: dict, path: str) -> bool:
    body = doc["paths"][path]["post"].get("requestBody") or {}
    schema = body.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("maxProperties") != 0


def small_generation(body):
    """Keep fuzzed generations short on a CPU mesh: cap lengths and counts (smaller
    values keep a schema-valid body valid), default max_tokens to 8."""
    if not isinstance(body, dict):
        return body

    def cap(d: dict, caps: dict) -> None:
        for key, limit in caps.items():
            if isinstance(d.get(key), int) and not isinstance(d.get(key), bool) and d[key] > limit:
                d[key] = limit

    cap(body, {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "min_tokens": 4})
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4 and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:4]
    if "model" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8
    if "text" in body or "input_ids" in body:
        if body.get("sampling_params") is None:
            body["sampling_params"] = {}
        sp = body["sampling_params"]
        cap(sp, {"max_new_tokens": 8, "n": 2, "min_new_tokens": 4})
        if sp.get("max_new_tokens") is None:
            sp["max_new_tokens"] = 8
    return body
