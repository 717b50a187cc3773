"""services/common/tool_formats/: each tool-call format parses finished outputs, streams the same
calls for any chunking, constrains calls with a structural tag that compiles, accepts its own
calls and refuses bad arguments, is detected from a chat template's source, and writes the
conversation for a template that takes no tools (services/tokenizer/tool_prompt.py)."""
from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from services.common.grammar.xgrammar_backend import XGrammarBackend
from services.common.tool_formats.base import Call
from services.common.tool_formats.registry import FORMATS, detect, tool_format
from services.gateway.shaping import merge_deltas
from services.gateway.tools import ToolCallStream, parse_output, plan_tools
from services.tokenizer.tool_prompt import inline_tools, native_format

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]
OSLO, TIME = ("get_weather", {"city": "Oslo"}), ("get_time", {})


def auto(fmt: str):
    return plan_tools({"tools": TOOLS}, fmt)


# (format, text, content, calls)
OUTPUTS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None, [OSLO]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.", [OSLO, TIME]),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}',
     '<tool_call>\n{"name": "get_time", "arguments": {}}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [OSLO]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [OSLO]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "arguments": {}}',
     None, [OSLO, TIME]),
    ("llama3_json", 'Let me check. {"name": "get_time", "parameters": {}}\nDone.', "Let me check. Done.", [TIME]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "a}b\\"{"}}', None,
     [("get_weather", {"city": 'a}b"{'})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ',
     '{"name": "get_weather", "parameters": {"city": ', []),
    ("llama3_json", 'The JSON {"name": "Bob", "age": 3} has no parameters; fine.',
     'The JSON {"name": "Bob", "age": 3} has no parameters; fine.', []),
    ("llama3_json", '<|python_tag|>search.call(query="x")', '<|python_tag|>search.call(query="x")', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [OSLO]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [OSLO, TIME]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', None, [TIME]),  # the special token skipped
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Checking.", [TIME]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}', []),
    ("mistral", 'Pick from [{"name": "a"}] or [TOOL_CALLS] nothing.',
     'Pick from [{"name": "a"}] or [TOOL_CALLS] nothing.', []),
]


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", OUTPUTS)
def test_a_finished_output_parses_into_content_and_calls(fmt, text, content, calls):
    got_content, got_calls = parse_output(auto(fmt), text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    id_shape = r"[0-9a-f]{9}" if fmt == "mistral" else r"call_[0-9a-f]{24}"  # Mistral's templates check ids
    assert all(re.fullmatch(id_shape, c["id"]) for c in got_calls)


def stream(fmt: str, text: str, size: int) -> tuple[str, list[tuple[str, dict]], bool]:
    """Feed `text` in pieces of `size`; assemble as the OpenAI SDK does: content appended, each
    call's fields by index, argument fragments concatenated."""
    s, content, slots = ToolCallStream(auto(fmt)), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for delta in [merge_deltas(s.feed(p)) for p in pieces] + [merge_deltas(s.finish())]:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            slot = slots.setdefault(call["index"], {"name": "", "arguments": ""})
            slot["name"] += call.get("function", {}).get("name") or ""
            slot["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, [(v["name"], json.loads(v["arguments"])) for _, v in sorted(slots.items())], s.called


@pytest.mark.parametrize("fmt,text,content,calls", OUTPUTS)
def test_streamed_in_any_pieces_the_calls_are_the_finished_outputs(fmt, text, content, calls):
    for size in range(1, 8):
        got_content, got_calls, called = stream(fmt, text, size)
        assert got_calls == calls and called == bool(calls), size
        assert got_content == text if not calls else got_content.strip() == (content or ""), size


def accepts(constraint_spec: str, text: str) -> bool:
    grammar = xgr.Grammar.from_structural_tag(constraint_spec)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_structural_tag_compiles_accepts_calls_and_refuses_bad_arguments(fmt):
    constraint = auto(fmt).constraint()
    XGrammarBackend().check(constraint)
    write = tool_format(fmt).write_calls
    assert accepts(constraint.spec, "It is sunny, no tool needed.")
    assert accepts(constraint.spec, "Let me look. " + write([Call(*OSLO), Call(*TIME)]))
    assert not accepts(constraint.spec, write([Call("get_weather", {"city": 3})]))
    assert not accepts(constraint.spec, write([Call("get_weather", {})]))
    assert not accepts(constraint.spec, write([Call("launch", {})]))


def test_mistral_constrains_the_bare_list_too_and_llama_a_compact_call():
    assert accepts(auto("mistral").constraint().spec, '[{"name": "get_time", "arguments": {}}]')
    assert not accepts(auto("mistral").constraint().spec, '[{"name": "get_weather", "arguments": {"city": 1}}]')
    assert not accepts(auto("llama3_json").constraint().spec, '{"name":"get_weather", "parameters": {"city": 1}}')


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {
    CHATML: "hermes",  # no tools: the tokenizer inlines the default format
    "{% if tools %}<tools>{{ tools | tojson }}</tools> Call with <tool_call></tool_call>{% endif %}" + CHATML: "hermes",
    '{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}' + CHATML: "llama3_json",
    "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% if m is defined %}<|python_tag|>{% endif %}" + CHATML:
        "llama3_json",
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}" + CHATML: "mistral",
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% endif %}"
    "{% endfor %}{{ tools }}": "mistral",
    "{% if tools %}Functions: {{ tools | tojson }}{% endif %}" + CHATML: "hermes",  # tools, no known marker
}


@pytest.mark.parametrize("source,expected", TEMPLATES.items())
def test_the_format_is_detected_from_the_template(source, expected):
    from services.tokenizer.chat_template import ChatTemplate
    ChatTemplate(source).render([{"role": "user", "content": "hi"}], tools=TOOLS)  # a real template
    assert native_format(source) == expected
    assert native_format(None) == detect(None) == "hermes"


TURNS = [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "x", "content": '{"temp": 18}'}]
WRITTEN = {  # (the call instruction's example, the earlier call, the tool's result)
    "hermes": ('<tool_call>\n{"name": <function name>', '<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Oslo"}}\n</tool_call>', '<tool_response>\n{"temp": 18}\n</tool_response>'),
    "llama3_json": ('{"name": <function name>, "parameters"', '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                    '{"temp": 18}'),
    "mistral": ('[TOOL_CALLS][{"name": <function name>', '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                '{"city": "Oslo"}}]', '[TOOL_RESULTS]{"temp": 18}[/TOOL_RESULTS]'),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_inline_tools_writes_the_chosen_format(fmt):
    system, user, assistant, tool = inline_tools(TURNS, TOOLS, tool_format(fmt))
    example, call, result = WRITTEN[fmt]
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"] and example in system["content"]
    assert user == TURNS[0] and "tool_calls" not in assistant and "tool_call_id" not in tool
    assert (assistant["content"], tool["content"]) == (call, result)
    assert calls_of(parse_output(auto(fmt), assistant["content"])[1]) == [OSLO]  # what the parser reads back
