"""The official `openai` client against the gateway on a loopback port, FakeBackend behind it."""
from __future__ import annotations

import openai
import pytest

from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

MSGS = [{"role": "user", "content": "say something"}]


@pytest.fixture(scope="module")
def gateway():
    with GatewayThread(FakeBackend()) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    (m,) = client.models.list().data
    return m.id


def test_models(client, model):
    assert model == "fake-model"
    assert client.models.retrieve(model).id == model


def test_chat_whole_and_streamed_agree(client, model):
    whole = client.chat.completions.create(model=model, messages=MSGS, max_tokens=10, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10
    assert whole.usage.prompt_tokens_details.cached_tokens is not None
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_completion_whole_and_streamed_agree(client, model):
    whole = client.completions.create(model=model, prompt="The sky is", max_tokens=7, temperature=0)
    chunks = list(client.completions.create(model=model, prompt="The sky is", max_tokens=7, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 7


def test_n2_and_extra_sampling_params(client, model):
    out = client.chat.completions.create(model=model, messages=MSGS, max_completion_tokens=4, n=2, seed=5,
                                         extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                                     "ignore_eos": True, "min_tokens": 2})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8
    streamed: dict[int, str] = {}
    for c in client.chat.completions.create(model=model, messages=MSGS, max_completion_tokens=4, n=2, seed=5,
                                            stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert streamed == {c.index: c.message.content for c in out.choices}


def test_logprobs_shapes(client, model):
    chat = client.chat.completions.create(model=model, messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="x y", max_tokens=3, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3


def test_errors_raise_the_right_exceptions(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nope", messages=MSGS)
    assert e.value.status_code == 400 and "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=model, prompt="x", echo=True, stream=True)


def test_queue_full_is_retryable(gateway, client, model):
    gateway.backend.queue_full = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=model, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
    finally:
        gateway.backend.queue_full = False
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices[0].text
