"""Gateway responses: OpenAI shapes, SSE framing, usage, failures mid-stream,
client disconnects aborting the backend call, readiness. FakeBackend, aiohttp
test client; async tests on pytest-asyncio."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.backend import GenerateCall
from services.gateway.config import GatewayConfig
from services.gateway.sse import DONE, frame
from services.gateway.state import STATE
from services.common.sampling_params import SamplingParams
from tests.doubles.fake_backend import FakeBackend

MODEL = "fake-model"
MSGS = [{"role": "user", "content": "tell me a story"}]


@asynccontextmanager
async def client_for(backend: FakeBackend, config: GatewayConfig | None = None, monitor: bool = False):
    app = build_app(config or GatewayConfig(), backend, monitor_backend=monitor)
    async with TestClient(TestServer(app)) as client:
        yield client


async def post(client, path, body):
    r = await client.post(path, json=body)
    return r.status, (await r.json() if r.headers["Content-Type"].startswith("application/json") else await r.text())


def sse_events(text: str) -> list:
    """Parse an SSE body strictly: `data: ...` events separated by blank lines, `[DONE]` last."""
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


async def stream(client, path, body) -> list:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status == 200, await r.text()
    assert r.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(await r.text())


def test_sse_frame_is_one_data_line():
    out = frame({"text": "a\nb", "emoji": "🙂"})
    assert out.startswith(b"data: ") and out.endswith(b"\n\n") and out.count(b"\n") == 2
    assert json.loads(out[6:]) == {"text": "a\nb", "emoji": "🙂"}
    assert DONE == b"data: [DONE]\n\n"


async def test_completion_shape_usage_and_cached_tokens():
    async with client_for(FakeBackend()) as c:
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 5, "temperature": 0}
        status, first = await post(c, "/v1/completions", body)
        _, again = await post(c, "/v1/completions", body)
    assert status == 200
    assert first["object"] == "text_completion" and first["model"] == MODEL and first["id"].startswith("cmpl-")
    (choice,) = first["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == choice["text"]  # greedy


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "once upon a time"}),
    ("/v1/chat/completions", {"messages": MSGS}),
])
async def test_streamed_deltas_concatenate_to_the_full_text(path, body):
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, **body}
    async with client_for(FakeBackend()) as c:
        _, whole = await post(c, path, body)
        events = await stream(c, path, {**body, "stream_options": {"include_usage": True}})
    chat = path.endswith("chat/completions")
    *chunks, usage = events
    assert usage["choices"] == []
    cached = usage["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert cached > 0 and usage["usage"] == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert all(e["usage"] is None for e in chunks)
    assert all(e["id"] == chunks[0]["id"] and e["object"] == ("chat.completion.chunk" if chat else "text_completion")
               for e in chunks)
    text = "".join(e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"] for e in chunks)
    expected = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert text == expected and text
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in e["choices"][0]["delta"] for e in chunks[1:])


async def test_stream_without_include_usage_has_no_usage_key():
    async with client_for(FakeBackend()) as c:
        events = await stream(c, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 3})
    assert all("usage" not in e for e in events)


async def test_n_sequences_and_batched_prompts_index_choices():
    async with client_for(FakeBackend()) as c:
        _, whole = await post(c, "/v1/completions", {"model": MODEL, "prompt": ["a b", "c d e"], "n": 2,
                                                     "max_tokens": 3, "temperature": 1, "seed": 1})
        events = await stream(c, "/v1/completions", {"model": MODEL, "prompt": ["a b", "c d e"], "n": 2,
                                                     "max_tokens": 3, "temperature": 1, "seed": 1})
    assert [ch["index"] for ch in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["prompt_tokens"] == 5 and whole["usage"]["completion_tokens"] == 12
    by_index: dict[int, str] = {}
    for e in events:
        (ch,) = e["choices"]
        by_index[ch["index"]] = by_index.get(ch["index"], "") + ch["text"]
    assert by_index == {ch["index"]: ch["text"] for ch in whole["choices"]}
    assert len({ch["text"] for ch in whole["choices"]}) == 4  # sequences differ


async def test_stop_string_cuts_the_text_and_reports_the_match():
    async with client_for(FakeBackend()) as c:
        _, free = await post(c, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8,
                                                    "temperature": 0})
        text = free["choices"][0]["text"]
        stop = text.split()[2][:3]  # starts inside the third word
        _, cut = await post(c, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8,
                                                   "temperature": 0, "stop": [stop]})
        events = await stream(c, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8,
                                                     "temperature": 0, "stop": stop})
    choice = cut["choices"][0]
    assert choice["text"] == text[:text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["matched_stop"] == stop


async def test_logprobs_in_openai_shapes():
    async with client_for(FakeBackend()) as c:
        _, comp = await post(c, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3,
                                                    "logprobs": 2})
        _, chat = await post(c, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 3,
                                                         "logprobs": True, "top_logprobs": 2})
        events = await stream(c, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 3,
                                                          "logprobs": True})
    lp = comp["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(item["bytes"]).decode() == item["token"]
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["token"] == item["token"]
    streamed = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["content"]]
    assert len(streamed) == 3 and all(t["top_logprobs"] == [] for t in streamed)


async def test_native_generate_whole_and_streamed():
    async with client_for(FakeBackend()) as c:
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        _, whole = await post(c, "/generate", body)
        events = await stream(c, "/generate", body)
        _, many = await post(c, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert len(whole["output_ids"]) == 4 and whole["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert whole["meta_info"]["prompt_tokens"] == 2 and whole["meta_info"]["completion_tokens"] == 4
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert [len(e["output_ids"]) for e in events[:4]] == [1, 2, 3, 4]  # cumulative, SGLang-style
    assert isinstance(many, list) and [m["meta_info"]["index"] for m in many] == [0, 1]
    assert len(many[0]["meta_info"]["output_token_logprobs"]) == 2


async def test_failure_mid_stream_is_an_error_event_before_done():
    async with client_for(FakeBackend(fail_after_tokens=2)) as c:
        events = await stream(c, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 8})
        status, whole = await post(c, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 8})
    assert "choices" in events[0] and events[-1]["error"]["message"] == "worker error: injected failure"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert status == 500 and whole["error"]["type"] == "server_error"


@pytest.mark.parametrize("streaming", [True, False])
async def test_client_disconnect_aborts_the_backend_call(streaming):
    backend = FakeBackend(token_delay_s=0.05)
    async with client_for(backend) as c:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 200, "stream": streaming}
        with pytest.raises(asyncio.TimeoutError):
            async with c.post("/v1/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        for _ in range(100):
            if backend.aborted:
                break
            await asyncio.sleep(0.02)
    assert backend.aborted == [backend.calls[0].rid] and not backend.active


async def test_readiness_follows_the_backend():
    backend = FakeBackend()
    seen = []
    async with client_for(backend, GatewayConfig(ready_interval_s=0.05), monitor=True) as c:
        for serving in (True, False, True):
            backend.is_serving = serving
            await asyncio.sleep(0.3)
            r = await c.get("/ready")
            seen.append((r.status, r.headers.get("Retry-After"), (await c.get("/health")).status))
    assert seen == [(200, None, 200), (503, "1", 200), (200, None, 200)]


async def test_ready_is_503_before_the_first_check():
    async with client_for(FakeBackend()) as c:
        r = await c.get("/ready")
        status, body = r.status, await r.json()
    assert status == 503 and "not been checked" in body["error"]["message"]


async def test_models_route_and_model_name_override():
    async with client_for(FakeBackend(), GatewayConfig(model_name="org/alias")) as c:
        models = await (await c.get("/v1/models")).json()
        one = await c.get("/v1/models/org/alias")
        missing = await c.get("/v1/models/other")
        status, _ = await post(c, "/v1/completions", {"model": "fake-model", "prompt": "x"})
    assert models["data"][0]["id"] == "org/alias" and models["data"][0]["max_model_len"] == 256
    assert (one.status, missing.status, status) == (200, 404, 400)


async def test_fake_backend_contract():
    """One Finish per index, counters cumulative: what the gateway relies on."""
    call = GenerateCall("r", SamplingParams(max_new_tokens=3), n=2, text="a b")
    events = [e async for batch in FakeBackend().generate(call) for e in batch]
    assert sorted(e.index for e in events if e.finished) == [0, 1]
    assert all(not e.token_ids for e in events if e.finished)  # a finishing output carries no tokens
    counts = [e.completion_tokens for e in events if not e.finished]
    assert counts == sorted(counts) and counts[-1] == 6


def test_state_key_is_exposed():
    app = build_app(GatewayConfig(), FakeBackend(), monitor_backend=False)
    assert app[STATE].served_name == ""  # unknown until the first check
