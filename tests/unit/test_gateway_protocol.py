"""Gateway request validation: each bad input → its status, OpenAI error envelope and message.

Through aiohttp's test client against the app with the in-process FakeBackend
(context length 256, vocabulary of len(WORDS) tokens); async tests on pytest-asyncio.
"""
from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.schemas import SchemaError, check
from tests.doubles.fake_backend import WORDS, FakeBackend

MODEL = "fake-model"
V = len(WORDS)
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hello there"}]


async def request(method: str, path: str, body=None, *, raw: bytes | None = None,
                  backend: FakeBackend | None = None, config: GatewayConfig | None = None):
    """One request against a fresh app; returns (status, headers, parsed JSON or text)."""
    app = build_app(config or GatewayConfig(), backend or FakeBackend(), monitor_backend=False)
    async with TestClient(TestServer(app)) as client:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        r = await client.request(method, path, data=data)
        text = await r.text()
        try:
            return r.status, r.headers, json.loads(text)
        except ValueError:
            return r.status, r.headers, text


def comp(**kw):
    return {"model": MODEL, "prompt": "hello world", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


BAD_400 = [
    # (path, body, message substring, param)
    (COMP, {"prompt": "x"}, "model is required", "model"),
    (COMP, comp(model="gpt-9"), "the model 'gpt-9' does not exist", "model"),
    (COMP, {"model": MODEL}, "prompt is required", "prompt"),
    (COMP, comp(prompt=123), "prompt must be a string or an array of strings or an array of integers or "
                             "an array of arrays", "prompt"),
    (COMP, comp(prompt=""), "prompt must not be empty", "prompt"),
    (COMP, comp(prompt=[]), "prompt must not be empty", "prompt"),
    (COMP, comp(prompt=[1, "a"]), "prompt[1] must be an integer", "prompt[1]"),
    (COMP, comp(prompt=[V + 5]), f"outside the vocabulary [0, {V})", "prompt"),
    (COMP, comp(prompt=[-1]), "prompt[0] must be in [0,", "prompt[0]"),
    (COMP, comp(temperature="hot"), "temperature must be a number or null", "temperature"),
    (COMP, comp(temperature=-0.5), "temperature must be in [0, 2]", "temperature"),
    (COMP, comp(temperature=2.5), "temperature must be in [0, 2]", "temperature"),
    (COMP, comp(top_p=0), "top_p must be in (0, 1]", "top_p"),
    (COMP, comp(top_k=-2), "top_k must be in [-1,", "top_k"),
    (COMP, comp(min_p=1.5), "min_p must be in [0, 1]", "min_p"),
    (COMP, comp(frequency_penalty=3), "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
    (COMP, comp(presence_penalty=-2.5), "presence_penalty must be in [-2, 2]", "presence_penalty"),
    (COMP, comp(repetition_penalty=0), "repetition_penalty must be in (0, 10]", "repetition_penalty"),
    (COMP, comp(max_tokens=-1), "max_tokens must be in [0,", "max_tokens"),
    (COMP, comp(max_tokens="5"), "max_tokens must be an integer or null", "max_tokens"),
    (COMP, comp(max_tokens=True), "max_tokens must be an integer or null", "max_tokens"),
    (COMP, comp(max_tokens=1.5), "max_tokens must be an integer or null", "max_tokens"),
    (COMP, comp(max_tokens=256), "leaves no room for the prompt", "max_tokens"),
    (COMP, comp(n=0), "n must be in [1, 16]", "n"),
    (COMP, comp(n=17), "n must be in [1, 16]", "n"),
    (COMP, comp(prompt=["a"] * 5, n=16), "more than 64 sequences", "n"),
    (COMP, comp(seed=-1), "seed must be in [0,", "seed"),
    (COMP, comp(logprobs=21), "logprobs must be in [0, 20]", "logprobs"),
    (COMP, comp(echo=True, stream=True), "echo and prompt_logprobs are not supported with stream", "echo"),
    (COMP, comp(best_of=2), "best_of is not supported", "best_of"),
    (COMP, comp(logit_bias={"5": 1}), "logit_bias is not supported", "logit_bias"),
    (COMP, comp(suffix="x"), "suffix is not supported", "suffix"),
    (COMP, comp(frobnicate=1), "unrecognized request argument: 'frobnicate'", "frobnicate"),
    (COMP, comp(stop=["a"] * 17), "stop must have at most 16 items", "stop"),
    (COMP, comp(stop=[""]), "stop[0] must not be empty", "stop[0]"),
    (COMP, comp(stop=7), "stop must be a string or an array of strings or null, got 7", "stop"),
    (COMP, comp(stop_token_ids=[V]), "stop_token_ids", "stop_token_ids"),
    (COMP, comp(min_tokens=5, max_tokens=4), "min_tokens (5) must be <= max_tokens (4)", "min_tokens"),
    (COMP, comp(stream_options={"include_usage": True}), "only allowed when stream is true", "stream_options"),
    (COMP, comp(stream=True, stream_options={"include_usge": True}), "unrecognized request argument in "
                                                                      "stream_options", "stream_options.include_usge"),
    (COMP, comp(prompt="a " * 200, max_tokens=100), "exceeds the model's context length of 256 tokens", None),
    (COMP, comp(prompt=[1] * 200, max_tokens=100), "exceeds the model's context length", "prompt"),
    (CHAT, {"model": MODEL}, "messages is required", "messages"),
    (CHAT, chat(messages=[]), "messages must not be empty", "messages"),
    (CHAT, chat(messages="hi"), "messages must be an array", "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role must be one of",
     "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content is required", "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type must be one of ['text'], got 'image_url'", "messages[0].content[0].type"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens must be in [1,", "max_completion_tokens"),
    (CHAT, chat(max_completion_tokens=300), "max_completion_tokens (300) leaves no room", "max_completion_tokens"),
    (CHAT, chat(top_logprobs=2), "top_logprobs requires logprobs=true", "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20]", "top_logprobs"),
    (CHAT, chat(logprobs=3), "logprobs must be a boolean or null", "logprobs"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={
        "type": "function", "function": {"name": "g"}}), "names the function 'g', which is not in tools", "tool_choice"),
    (CHAT, chat(tool_choice="required"), '"required" needs tools', "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "distinct function names", "tools"),
    (CHAT, chat(response_format={"type": "json_object"}, regex="a+"), "at most one output constraint", "regex"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type must be one of", "response_format.type"),
    (CHAT, chat(response_format={"type": "json_schema"}), "needs json_schema", "response_format.json_schema"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                response_format={"type": "json_object"}), "constrains the output already", "tool_choice"),
    (CHAT, chat(messages=[{"role": "tool", "content": "4"}]), "messages[0].tool_call_id is required", "messages[0].tool_call_id"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content is required", "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": "a " * 300}]), "context length", None),
    ("/generate", {}, "give exactly one of text and input_ids", "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, "give exactly one of text and input_ids", "text"),
    ("/generate", {"text": ""}, "text must not be empty", "text"),
    ("/generate", {"input_ids": [V]}, "outside the vocabulary", "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}},
     "sampling_params.max_new_tokens must be in [0,", "sampling_params.max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "sampling_params.min_new_tokens (3) must be <= sampling_params.max_new_tokens (2)",
     "sampling_params.min_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, "must be in [0, inf)",
     "sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"max_tokens": 3}}, "unrecognized request argument in "
                                                                       "sampling_params", "sampling_params.max_tokens"),
]


@pytest.mark.parametrize("path,body,message,param", BAD_400, ids=[f"{i}-{b[2][:30]}" for i, b in enumerate(BAD_400)])
async def test_bad_input_is_a_400_with_an_actionable_message(path, body, message, param):
    status, _, out = await request("POST", path, body)
    assert status == 400, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


@pytest.mark.parametrize("raw,message", [
    (b"{not json", "not valid JSON"),
    (b'{"model": "fake-model", "prompt": "a", "temperature": NaN}', "NaN is not valid JSON"),
    (b'{"model": "fake-model", "prompt": "a", "temperature": 1e400}', "temperature must be a finite number"),
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "fake-model", "prompt": "a\\udc00"}', "a lone UTF-16 surrogate"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
])
async def test_malformed_json_is_a_400(raw, message):
    status, _, out = await request("POST", COMP, raw=raw)
    assert status == 400
    assert message in out["error"]["message"]


async def test_unknown_route_is_a_404_and_wrong_method_a_405_in_the_envelope():
    status, _, out = await request("GET", "/v1/nope")
    assert status == 404 and out["error"]["code"] == "unknown_route"
    status, headers, out = await request("GET", COMP)
    assert status == 405 and "POST" in headers["Allow"] and out["error"]["type"] == "invalid_request_error"


async def test_body_over_the_limit_is_a_413():
    status, _, out = await request("POST", COMP, comp(prompt="a " * 2000), config=GatewayConfig(max_request_bytes=2048))
    assert status == 413
    assert "--max-request-bytes (2048 bytes)" in out["error"]["message"]


async def test_queue_full_is_a_503_with_retry_after():
    status, headers, out = await request("POST", CHAT, chat(), backend=FakeBackend(queue_full=True),
                                         config=GatewayConfig(retry_after_s=3))
    assert status == 503 and headers["Retry-After"] == "3"
    assert out["error"]["code"] == "resource_exhausted" and "waiting" in out["error"]["message"]
    status, headers, _ = await request("POST", CHAT, chat(stream=True), backend=FakeBackend(queue_full=True))
    assert status == 503 and "Retry-After" in headers  # refused before the stream starts


async def test_backend_down_is_a_503_with_retry_after():
    status, headers, out = await request("POST", COMP, comp(), backend=FakeBackend(is_serving=False))
    assert status == 503 and headers["Retry-After"] == "1"
    assert out["error"]["code"] == "not_ready"
    status, headers, _ = await request("GET", "/v1/models", backend=FakeBackend(is_serving=False))
    assert status == 503 and "Retry-After" in headers


async def test_good_variants_are_accepted():
    for path, body in [
        (COMP, comp(prompt=["a b", "c"], n=2, stop="x", seed=3, temperature=0.7, top_k=5, min_p=0.1,
                    repetition_penalty=1.1, ignore_eos=True, min_tokens=1, stop_token_ids=[1], user="u",
                    echo=False, best_of=1, logit_bias={}, suffix=None, logprobs=0)),
        (COMP, comp(prompt=[[1, 2], [3]], max_tokens=2.0, temperature=None)),
        (CHAT, chat(max_tokens=None, max_completion_tokens=3, logprobs=True, top_logprobs=0, tools=[],
                    tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=False,
                    messages=[{"role": "developer", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"}])),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "n": 2},
                       "return_logprob": True, "top_logprobs_num": 2, "rid": "abc"}),
    ]:
        status, _, out = await request("POST", path, body)
        assert status == 200, (path, out)


async def test_parsed_values_reach_the_backend():
    backend = FakeBackend()
    await request("POST", CHAT, chat(max_tokens=9, max_completion_tokens=5, temperature=0, stop="end", seed=7, n=2,
                                     top_k=3, min_tokens=1, stop_token_ids=[2], ignore_eos=True,
                                     messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]),
                  backend=backend)
    (call,) = backend.calls
    sp = call.sampling
    assert (sp.max_new_tokens, sp.temperature, sp.stop, sp.seed, sp.top_k, sp.min_new_tokens) == (5, 0.0, ["end"], 7, 3, 1)
    assert sp.stop_token_ids == [2] and sp.ignore_eos and call.n == 2
    assert call.messages == [{"role": "system", "content": "a\nb"}]
    assert call.rid.startswith("chatcmpl-")


async def test_default_max_tokens_from_config():
    backend = FakeBackend()
    config = GatewayConfig(default_max_tokens=7)
    await request("POST", COMP, {"model": MODEL, "prompt": "x"}, backend=backend, config=config)
    assert (backend.calls[0].fill_context, backend.calls[0].fill_cap) == (True, 7)
    assert backend.calls[0].sampling.max_new_tokens == 7
    # a cap, not a fixed length: a prompt near the context still fits (254 + 2)
    status, _, out = await request("POST", COMP, {"model": MODEL, "prompt": [1] * 254, "temperature": 0,
                                                  "ignore_eos": True}, backend=backend, config=config)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    await request("POST", "/generate", {"text": "x"}, backend=backend, config=config)  # SGLang's: a fixed default
    assert not backend.calls[-1].fill_context and backend.calls[-1].sampling.max_new_tokens == 7


def test_schema_checker_follows_json_semantics():
    assert check({"type": "integer"}, 3.0) == 3 and isinstance(check({"type": "integer"}, 3.0), int)
    for schema, value in [({"enum": [False, None]}, 0), ({"type": "integer"}, True), ({"type": "number"}, "1"),
                          ({"enum": [1]}, True), ({"type": "number"}, float("inf"))]:
        with pytest.raises(SchemaError):
            check(schema, value)


async def test_no_max_tokens_fills_what_the_context_leaves():
    """OpenAI's default: a prompt 100 tokens short of the context (256) with no max_tokens
    runs to the context's end instead of a 400 for prompt + a fixed default; the gateway
    leaves max_tokens to the backend (fill_context), capped by --default-max-tokens."""
    backend = FakeBackend()
    long_prompt = " ".join(["hello"] * 156)
    status, _, out = await request("POST", COMP, {"model": MODEL, "prompt": long_prompt, "temperature": 0,
                                                  "ignore_eos": True}, backend=backend)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 100
    (call,) = backend.calls
    assert call.fill_context and call.fill_cap is None
    status, _, out = await request("POST", CHAT, {"model": MODEL, "messages": MSGS, "min_tokens": 300}, backend=backend)
    assert status == 400 and "must be <= max_tokens, which defaults to what the context leaves" in \
        out["error"]["message"], out
    status, _, out = await request("POST", COMP, {"model": MODEL, "prompt": [1] * 256}, backend=backend)
    assert status == 400 and "leaves no room for output" in out["error"]["message"], out
    # An explicit max_tokens is sent as given, and the whole of prompt + max_tokens must fit.
    status, _, out = await request("POST", COMP, {"model": MODEL, "prompt": long_prompt, "max_tokens": 128},
                                   backend=backend)
    assert status == 400 and "exceeds the model's context length" in out["error"]["message"], out
    assert not backend.calls[-1].fill_context


async def test_completions_honour_max_completion_tokens_too():
    """The shared schema accepts the newer name on both routes; /v1/completions once ignored it
    and generated to the end of the context (found by the real-mesh fuzz test)."""
    backend = FakeBackend()
    await request("POST", COMP, {"model": MODEL, "prompt": "x", "max_completion_tokens": 3}, backend=backend)
    await request("POST", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 9, "max_completion_tokens": 4},
                  backend=backend)
    assert [c.sampling.max_new_tokens for c in backend.calls] == [3, 4]
    assert not backend.calls[0].fill_context
    status, _, out = await request("POST", COMP, {"model": MODEL, "prompt": "x", "max_completion_tokens": 0})
    assert status == 400 and out["error"]["param"] == "max_completion_tokens"
