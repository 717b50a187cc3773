"""The Responses API and tokenize/detokenize on a real mesh (`radixmesh up` on the default model),
through the official `openai` client: streamed events in order, tool calls as function_call
items and their output continuing the conversation (previous_response_id), text.format's JSON
schema honoured, a bad parameter named; the tokenizer's Detokenize RPC behind /detokenize."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

import services.launcher.up  # noqa: E402,F401 (the launcher the tests drive)

from tests.integration.mesh_harness import Mesh  # noqa: E402

pytestmark = pytest.mark.slow

MESH_FLAGS = ["--kv-cache-bytes", str(32 << 20), "--max-requests", "4", "--max-running-requests", "4",
              "--context-length", "1024"]
TOOLS = [{"type": "function", "name": "get_weather", "description": "the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def url():
    m = Mesh(*MESH_FLAGS, gateway=True)
    try:
        m.wait_ready()
        listening = next(e for e in m.log if e.get("service") == "gateway" and e.get("msg") == "listening")
        yield f"http://127.0.0.1:{listening['http_port']}"
        assert m.stop() == 0
        assert m.leftover_children() == []
    finally:
        m.kill_all()


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_stream_events_arrive_in_order(client, model):
    with client.responses.stream(model=model, input="What is the capital of France?", instructions="Be brief.",
                                 max_output_tokens=8, temperature=0) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output[0].content[0].text == text
    stored = client.responses.retrieve(events[0].response.id)
    assert stored.output_text == text and stored.usage.output_tokens == 8


def test_tool_call_then_its_output_continues_the_conversation(client, model, url):
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice="required", max_output_tokens=40, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    nxt = client.responses.create(model=model, previous_response_id=r.id, max_output_tokens=8, temperature=0,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": json.dumps({"weather": "sunny, 21 C"})}])
    assert nxt.previous_response_id == r.id and nxt.output_text
    # the prompt was the whole conversation: the question, the call, its output
    conversation = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": call.call_id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": json.dumps({"weather": "sunny, 21 C"})}]
    assert nxt.usage.input_tokens == post(url, "/tokenize", {"messages": conversation})["count"]


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
    r = client.responses.create(model=model, input="Alice is 30. Give her as JSON.", max_output_tokens=48,
                                temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                "schema": schema, "strict": True}})
    assert r.status == "completed"
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_bad_parameter_is_named(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", max_output_tokens=4096)
    assert e.value.body["param"] == "max_output_tokens"


def test_tokenize_and_detokenize_round_trip(url):
    out = post(url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) == 2 and out["token_strs"] == ["Hello", "Ġworld"]
    assert out["max_model_len"] == 1024
    assert post(url, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": "Hello world"}
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Hello world"}]})
    assert chat["count"] > out["count"]
    assert post(url, "/v1/detokenize", {"tokens": [out["tokens"], chat["tokens"]]})["text"][0] == "Hello world"
