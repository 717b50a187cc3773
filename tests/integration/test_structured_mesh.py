"""Structured outputs and tools through the real mesh (`radixmesh up` with the gateway), driven by
the OpenAI SDK as a user would: the JSON-schema suite (bench/common/structured_cases.py) greedy and
sampled, streamed and not, regex/choice/EBNF extras, tool calls with `required` and a named
function, a follow-up turn with the tool's result, 400s for bad constraints, and what the worker
reports (/metrics, the grammar.compile span)."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from bench.common.structured_cases import MAX_TOKENS, SCHEMA_CASES
from protos.radixmesh.v1 import common_pb2, tokenizer_pb2

from tests.integration.mesh_harness import collect
# The observability module's mesh (gateway, --metrics-port 0, traces to an OTLP receiver), one per module.
from tests.integration.test_mesh_observability import mesh, receiver, scrape, total  # noqa: F401

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather now in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the local time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(mesh) -> OpenAI:
    return OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat_text(client: OpenAI, model: str, stream: bool, **kw) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model=model, **kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# (sampling, stream): greedy both ways, and temperature 0.8 at two seeds
RUNS = [({"temperature": 0}, False), ({"temperature": 0}, True),
        ({"temperature": 0.8, "seed": 1}, False), ({"temperature": 0.8, "seed": 2}, True)]


def test_every_schema_case_validates_greedy_and_sampled_streamed_or_not(client, model):
    jobs = [(name, prompt, schema, sampling, stream) for name, prompt, schema in SCHEMA_CASES
            for sampling, stream in RUNS]

    def run(job):
        name, prompt, schema, sampling, stream = job
        return chat_text(client, model, stream, messages=[{"role": "user", "content": prompt}],
                         response_format=schema_format(name, schema), max_tokens=MAX_TOKENS, **sampling)

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, jobs))
    assert len(SCHEMA_CASES) >= 25
    for (name, _, schema, sampling, stream), (text, reason) in zip(jobs, outputs):
        label = f"{name} {sampling} stream={stream}: {text!r}"
        assert reason == "stop", label
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_regex_choice_and_ebnf(client, model):
    text, reason = chat_text(client, model, False, response_format={"type": "json_object"}, max_tokens=MAX_TOKENS,
                             temperature=0, messages=[{"role": "user", "content": 'Reply with {"name": "Tom"} as JSON.'}])
    assert reason == "stop" and isinstance(json.loads(text), dict), text
    phone = client.completions.create(model=model, prompt="Call me at ", max_tokens=16, temperature=0.8, seed=3,
                                      extra_body={"regex": r"\(\d{3}\) \d{3}-\d{4}"}).choices[0].text
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone), phone
    for stream in (False, True):
        answer, _ = chat_text(client, model, stream, messages=[{"role": "user", "content": "Is the sea wet?"}],
                              extra_body={"choice": ["yes", "no", "maybe"]}, max_tokens=8, temperature=0.8, seed=5)
        assert answer in ("yes", "no", "maybe")
    ebnf = 'root ::= "Answer: " digit digit? (" apples" | " pears")\ndigit ::= [0-9]'
    out = client.completions.create(model=model, prompt="How many fruits are there? ", max_tokens=16,
                                    temperature=0, extra_body={"ebnf": ebnf}).choices[0].text
    assert re.fullmatch(r"Answer: [0-9]{1,2} (apples|pears)", out), out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_validate_against_the_tool_schema(client, model, tool_choice, stream):
    kw = dict(model=model, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=tool_choice,
              max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kw):
            state.handle_chunk(chunk)
        choice = state.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_follow_up_turn_with_the_tool_result(client, model):
    first = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0].message
    call = first.tool_calls[0]
    turns = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    reply = client.chat.completions.create(model=model, messages=turns, tools=[WEATHER], max_tokens=24,
                                           temperature=0).choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert reply.message.content or reply.message.tool_calls


@pytest.mark.parametrize("kw,reason", [
    ({"response_format": schema_format("bad", {"type": "objec"})}, 'Unsupported type "objec"'),
    ({"extra_body": {"regex": "a(b"}}, "The parenthesis is not closed"),
    ({"extra_body": {"ebnf": 'root ::= "a" b'}}, 'Rule "b" is not defined'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "names the function 'launch', which is not in tools"),
], ids=["schema", "regex", "ebnf", "tool name"])
def test_bad_constraints_are_400s_and_the_mesh_keeps_serving(client, model, kw, reason):
    for stream in (False, True):
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model=model, messages=ASK_WEATHER, max_tokens=4, stream=stream, **kw)
        assert reason in str(err.value)
    text, _ = chat_text(client, model, False, messages=ASK_WEATHER, max_tokens=4, temperature=0)
    assert text


def test_the_worker_reports_compiles_cache_hits_and_masked_rows(mesh, client, model, receiver):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reordered = {"required": ["n"], "properties": {"n": {"type": "integer"}}, "type": "object"}
    before = scrape(mesh.metrics_urls["worker"])
    for s in (schema, reordered):  # the same canonical schema: one compile
        chat_text(client, model, False, messages=[{"role": "user", "content": "Pick a number."}],
                  response_format=schema_format("n", s), max_tokens=12, temperature=0)
    after = scrape(mesh.metrics_urls["worker"])

    def grew(name):
        return total(after, name) - total(before, name)

    assert grew("radixmesh:worker_grammar_cache_misses_total") == 1
    assert grew("radixmesh:worker_grammar_compile_seconds_count") == 1
    assert grew("radixmesh:worker_grammar_masked_rows_total") >= 2
    deadline = time.monotonic() + 60  # the worker exports its spans in batches
    while not (spans := [s for s in receiver.spans() if s.name == "grammar.compile"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spans and {s.attributes["radixmesh.grammar.kind"] for s in spans} >= {"json_schema"}
    assert all(s.service == "radixmesh-worker" for s in spans)


def test_grpc_clients_get_invalid_argument_and_constrained_output(mesh):
    """The tokenizer's Generate, the gRPC door: the constraint travels in SamplingParams."""
    bad = common_pb2.SamplingParams(max_new_tokens=8, constraint=common_pb2.Constraint(kind="regex", spec="a(b"))
    with pytest.raises(grpc.RpcError) as err:
        collect(mesh.tokenizer().Generate(tokenizer_pb2.GenerateTextRequest(text="x", sampling=bad), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "The parenthesis is not closed" in err.value.details()
    good = common_pb2.SamplingParams(max_new_tokens=12, temperature=0.0,
                                     constraint=common_pb2.Constraint(kind="regex", spec=r"[0-9]{4}"))
    seqs = collect(mesh.tokenizer().Generate(
        tokenizer_pb2.GenerateTextRequest(text="The year is", sampling=good), timeout=60))
    seq = seqs[0]
    assert re.fullmatch(r"[0-9]{4}", seq["text"]), seq
