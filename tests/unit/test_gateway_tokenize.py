"""/tokenize, /detokenize (vLLM's shapes) and /v1/tokenize, /v1/detokenize (SGLang's), FakeBackend behind."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.doubles.fake_backend import WORDS, FakeBackend
from tests.doubles.gateway_thread import GatewayThread


@pytest.fixture(scope="module")
def gateway():
    with GatewayThread(FakeBackend()) as gw:
        yield gw


def post(gw, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(gw.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_vllm_tokenize_prompt_and_messages(gateway):
    status, out = post(gateway, "/tokenize", {"prompt": "two words", "return_token_strs": True})
    assert status == 200 and out["count"] == 3 and out["max_model_len"] == 256  # the fake's BOS, two words
    assert out["token_strs"] == [WORDS[t] for t in out["tokens"]]
    _, chat = post(gateway, "/tokenize", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] == 3 and chat["token_strs"] is None  # "user: hi assistant:", no special tokens
    _, bare = post(gateway, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                          "add_generation_prompt": False, "add_special_tokens": True})
    assert bare["count"] == 3 and bare["tokens"][0] == 0


def test_vllm_detokenize(gateway):
    assert post(gateway, "/detokenize", {"tokens": [1, 2, 0]}) == (200, {"prompt": WORDS[1] + WORDS[2]})


def test_sglang_shapes(gateway):
    _, one = post(gateway, "/v1/tokenize", {"prompt": "a b", "add_special_tokens": False})
    assert one["count"] == 2 and len(one["tokens"]) == 2 and one["max_model_len"] == 256
    _, many = post(gateway, "/v1/tokenize", {"prompt": ["a", "b c"]})
    assert many["count"] == [2, 3] and [len(t) for t in many["tokens"]] == [2, 3]
    assert post(gateway, "/v1/detokenize", {"tokens": [1, 2]}) == (200, {"text": WORDS[1] + WORDS[2]})
    assert post(gateway, "/v1/detokenize", {"tokens": [[1], [0, 2]], "skip_special_tokens": False}) == (
        200, {"text": [WORDS[1], WORDS[0] + WORDS[2]]})


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/v1/detokenize", {"tokens": [10**6]}, None),  # outside the vocabulary: the backend's message
    ("/v1/tokenize", {"prompt": 3}, "prompt"),
])
def test_bad_input_is_a_400(gateway, path, body, param):
    status, out = post(gateway, path, body)
    assert status == 400 and out["error"]["param"] == param, out
