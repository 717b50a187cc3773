"""services/gateway/tools.py: tool_choice → constraint, output → tool_calls, and the streamed
deltas assembled the way the OpenAI SDK does equal the whole response's calls."""
from __future__ import annotations

import json

import pytest

from services.common.grammar.constraint import JSON_SCHEMA, STRUCTURAL_TAG
from services.common.grammar.xgrammar_backend import XGrammarBackend
from services.gateway.errors import APIError
from services.gateway.shaping import merge_deltas
from services.gateway.tools import ToolCallStream, parse_output, plan_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]


def plan(choice):
    return plan_tools({"tools": TOOLS, "tool_choice": choice})


def test_modes_and_their_constraints_compile():
    checker = XGrammarBackend()
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.constraint().kind == JSON_SCHEMA
    assert json.loads(named.constraint().spec) == PARAMS
    required, auto = plan("required"), plan("auto")
    assert required.constraint().kind == JSON_SCHEMA and auto.constraint().kind == STRUCTURAL_TAG
    for p in (named, required, auto):
        checker.check(p.constraint())  # xgrammar accepts what we build
    assert plan("none") is None and plan_tools({"tools": TOOLS}).mode == "auto"
    assert plan_tools({}) is None


@pytest.mark.parametrize("body,fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "distinct"),
])
def test_bad_tool_requests_are_400s(body, fragment):
    with pytest.raises(APIError) as err:
        plan_tools(body)
    assert err.value.status == 400 and fragment in err.value.message


OUTPUTS = [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}',
     None, [("get_weather", {"city": "Paris"})]),
    ("required", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("auto", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("auto", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    ("auto", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]


@pytest.mark.parametrize("choice,text,content,calls", OUTPUTS)
def test_whole_output_and_stream_give_the_same_calls(choice, text, content, calls):
    p = plan(choice)
    got_content, got_calls = parse_output(p, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    # stream it in 3-character pieces and assemble as the SDK does (by index, arguments appended)
    stream, text_out, assembled = ToolCallStream(p), "", {}
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    deltas = [merge_deltas(stream.feed(piece)) for piece in pieces] + [merge_deltas(stream.finish())]
    for d in deltas:
        text_out += d.get("content", "")
        for call in d.get("tool_calls", []):
            slot = assembled.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function", {})
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    assert [(s["name"], json.loads(s["arguments"])) for _, s in sorted(assembled.items())] == calls
    assert all(s["id"].startswith("call_") for s in assembled.values())
    assert stream.called == bool(calls)
    if choice == "auto" and not calls:
        assert text_out == text  # plain text streams through unchanged
