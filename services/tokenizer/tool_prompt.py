"""Tools for a chat template that has no notion of them: Hermes-style text in the conversation.

A template that renders `tools` (Qwen, Llama 3.1, Mistral, ...) gets them as they are. For one
that does not (SmolLM2's ChatML), the tools are described in the system message with the
format to call them in, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, which
is what the gateway's tool-call parser reads back (services/gateway/tools.py); earlier calls and
their results are written into the turns the same way.
"""
from __future__ import annotations

import json
from typing import Any


def template_takes_tools(source: str | None) -> bool:
    return bool(source) and "tools" in source


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages with the tools in the system message and tool calls/results as text."""
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    preamble = ("You can call functions. The available functions are listed in <tools></tools>:\n"
                f"<tools>\n{described}\n</tools>\n"
                "To call a function, answer with one <tool_call></tool_call> block per call:\n"
                '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{preamble}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": preamble})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [_call_block(c) for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if m.get("content") is None:
            m["content"] = ""
    return out


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # kept as the string the client sent
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"
