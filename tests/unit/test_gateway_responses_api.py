"""The Responses API (POST/GET /v1/responses, cancel) through the official `openai` client,
FakeBackend behind the gateway; the store's bounds on a fake clock."""
from __future__ import annotations

import threading

import openai
import pytest

from services.common.grammar.constraint import json_schema
from services.gateway.openapi import document
from services.gateway.responses_store import ResponseStore, Stored
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

MODEL = "fake-model"
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def gateway():
    with GatewayThread(FakeBackend()) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_stream_events_in_order_and_the_final_response_is_stored(client):
    # "eos" in the prompt: the fake model stops on its own after two tokens (status completed)
    with client.responses.stream(model=MODEL, input="a eos b", instructions="be brief", max_output_tokens=8) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and final.output_text == events[6].text
    assert final.usage.output_tokens == 3  # two words and EOS
    whole = client.responses.create(model=MODEL, input="a eos b", instructions="be brief", max_output_tokens=8)
    assert whole.output_text == final.output_text and whole.status == "completed"
    got = client.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == final.output_text and got.status == "completed"


def test_max_output_tokens_ends_incomplete(client):
    r = client.responses.create(model=MODEL, input="tell me", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_tool_calls_come_as_function_call_items(client, gateway):
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input="weather in Paris?", tools=TOOLS, tool_choice=choice,
                                max_output_tokens=4)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.arguments
    assert gateway.backend.calls[-1].tools == [{"type": "function", "function": {
        k: v for k, v in TOOLS[0].items() if k != "type"}}]
    with client.responses.stream(model=MODEL, input="weather in Paris?", tools=TOOLS, tool_choice=choice,
                                 max_output_tokens=4) as s:
        types = [e.type for e in s]
    assert types[2] == "response.output_item.added" and "response.function_call_arguments.delta" in types
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.incomplete"]

    # the call's result goes back as a function_call_output item, continuing the stored response
    client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=2,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    messages = gateway.backend.calls[-1].messages
    assert messages[0] == {"role": "user", "content": "weather in Paris?"}
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}


def test_text_format_json_schema_constrains_the_output(client, gateway):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    client.responses.create(model=MODEL, input="a name", max_output_tokens=2,
                            text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert gateway.backend.calls[-1].sampling.constraint == json_schema(schema)


def test_previous_response_id_and_store(client, gateway):
    first = client.responses.create(model=MODEL, input="first turn", instructions="sys", max_output_tokens=2)
    client.responses.create(model=MODEL, input="second turn", previous_response_id=first.id, max_output_tokens=2)
    messages = gateway.backend.calls[-1].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]  # instructions are not carried over
    assert messages[1]["content"] == first.output_text and messages[2]["content"] == "second turn"

    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id" and unstored.id in e.value.body["message"]


@pytest.mark.parametrize("kwargs,param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"max_output_tokens": 500}, "max_output_tokens"),  # beyond the context (256)
])
def test_bad_input_is_a_400_naming_the_parameter(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", **kwargs})
    assert e.value.body["param"] == param, e.value.body


def test_cancel_stops_a_response_in_progress(client, gateway):
    gateway.backend.token_delay_s = 0.05
    try:
        with client.responses.stream(model=MODEL, input="long story", max_output_tokens=200) as s:
            first = next(iter(s))
            out: dict = {}
            t = threading.Thread(target=lambda: out.update(r=client.responses.cancel(first.response.id)))
            t.start()
            types = [e.type for e in s]
            t.join(10)
    finally:
        gateway.backend.token_delay_s = 0.0
    assert out["r"].status == "cancelled" and types[-1] == "response.incomplete"
    assert client.responses.retrieve(first.response.id).status == "cancelled"
    assert gateway.backend.aborted[-1].startswith("chatcmpl-")
    with pytest.raises(openai.BadRequestError):  # it ended: a completed one cannot be cancelled
        done = client.responses.create(model=MODEL, input="a eos b", max_output_tokens=8)
        client.responses.cancel(done.id)


def test_store_is_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(max_size=2, ttl_s=10, clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        store.put(Stored({"id": rid, "status": "completed"}))
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    now[0] = 10.0
    assert store.get("b") is None and len(store) == 0


def test_openapi_documents_the_routes():
    paths = document(MODEL)["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"} <= set(paths)
