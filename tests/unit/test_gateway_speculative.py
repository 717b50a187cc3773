"""Speculative decoding at the gateway: the per-request opt-out (`speculative`) reaches the
backend's SamplingParams, and the backend's counters come out as `usage.speculative` (OpenAI
routes) and meta_info's spec_* keys (/generate), absent when nothing speculated.
FakeBackend(draft_tokens=3): every token produced is one verify step drafting 3, accepting 2."""
from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from tests.doubles.fake_backend import FakeBackend

MODEL = "fake-model"
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
BODIES = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4},
    COMP: {"model": MODEL, "prompt": "hello world", "max_tokens": 4},
}


async def call(backend: FakeBackend, path: str, body: dict):
    """(status, parsed JSON or the SSE events' JSON objects) of one request against a fresh app."""
    app = build_app(GatewayConfig(), backend, monitor_backend=False)
    async with TestClient(TestServer(app)) as client:
        r = await client.post(path, data=json.dumps(body))
        text = await r.text()
    if not r.headers["Content-Type"].startswith("text/event-stream"):
        return r.status, json.loads(text)
    blocks = text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    return r.status, [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def spec(steps: int, draft: int = 3, accepted: int = 2) -> dict:
    return {"verify_steps": steps, "draft_tokens": steps * draft, "accepted_tokens": steps * accepted,
            "acceptance_rate": round(accepted / draft, 4)}


# --- the opt-out ------------------------------------------------------------------------------

@pytest.mark.parametrize("path,extra", [
    (CHAT, {"speculative": False}), (COMP, {"speculative": False}),
    (GEN, {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "speculative": False}}),
])
async def test_speculative_false_reaches_the_sampling_params(path, extra):
    backend = FakeBackend()
    status, _ = await call(backend, path, {**BODIES.get(path, {}), **extra})
    assert status == 200
    assert backend.calls[-1].sampling.speculative is False


@pytest.mark.parametrize("path,extra", [
    (CHAT, {}), (COMP, {"speculative": None}), (CHAT, {"speculative": True}),
    (GEN, {"text": "hello world", "sampling_params": {"max_new_tokens": 4}}),
])
async def test_speculative_defaults_to_true(path, extra):
    backend = FakeBackend()
    status, _ = await call(backend, path, {**BODIES.get(path, {}), **extra})
    assert status == 200
    assert backend.calls[-1].sampling.speculative is True


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {**BODIES[CHAT], "speculative": "no"}, "speculative"),
    (COMP, {**BODIES[COMP], "speculative": 0}, "speculative"),
    (GEN, {"text": "hi", "sampling_params": {"speculative": 1}}, "sampling_params.speculative"),
])
async def test_a_non_boolean_speculative_is_a_400(path, body, param):
    backend = FakeBackend()
    status, err = await call(backend, path, body)
    assert status == 400, err
    assert err["error"]["param"] == param and "must be a boolean or null" in err["error"]["message"]
    assert backend.calls == []


# --- the counters -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_usage_carries_the_counters_summed_over_sequences(path):
    status, body = await call(FakeBackend(draft_tokens=3), path, {**BODIES[path], "n": 2})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["speculative"] == spec(8)


async def test_usage_sums_the_counters_over_prompts():
    body = {**BODIES[COMP], "prompt": ["a b", "c d e"], "max_tokens": 3}
    status, out = await call(FakeBackend(draft_tokens=3), COMP, body)
    assert status == 200 and out["usage"]["speculative"] == spec(6)


@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_streamed_usage_carries_the_counters(path):
    body = {**BODIES[path], "stream": True, "stream_options": {"include_usage": True}}
    status, events = await call(FakeBackend(draft_tokens=3), path, body)
    assert status == 200
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["speculative"] == spec(4)
    assert all(e["usage"] is None for e in chunks)


@pytest.mark.parametrize("draft,extra", [
    (0, {}),  # a backend that never speculates: OpenAI's usage, unchanged
    (3, {"speculative": False}),  # the request opted out
])
@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_no_speculation_leaves_usage_as_openai_has_it(draft, extra, path):
    backend = FakeBackend(draft_tokens=draft)
    _, whole = await call(backend, path, {**BODIES[path], **extra})
    _, events = await call(backend, path, {**BODIES[path], **extra, "stream": True,
                                           "stream_options": {"include_usage": True}})
    for usage in (whole["usage"], events[-1]["usage"]):
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


async def test_generate_meta_info_has_sglangs_spec_verify_ct():
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "n": 2}}
    status, objs = await call(FakeBackend(draft_tokens=3), GEN, body)
    assert status == 200 and len(objs) == 2
    for obj in objs:  # request-level, like prompt_tokens
        info = obj["meta_info"]
        assert (info["spec_verify_ct"], info["spec_draft_tokens"], info["spec_accepted_tokens"],
                info["spec_acceptance_rate"]) == (8, 24, 16, 0.6667)
    _, events = await call(FakeBackend(draft_tokens=3), GEN, {**body, "stream": True})
    assert events[-1]["meta_info"]["spec_verify_ct"] == 8


async def test_generate_meta_info_has_no_spec_keys_without_speculation():
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "speculative": False}}
    _, obj = await call(FakeBackend(draft_tokens=3), GEN, body)
    assert not any(k.startswith("spec_") for k in obj["meta_info"])
