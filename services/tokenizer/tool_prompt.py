"""Tools for a chat template that has no notion of them: the calling format written into the text.

A template that renders `tools` (Qwen, Llama 3.1, Mistral, ...) gets them as they are, and
`native_format` names the format it writes calls in (services/common/tool_formats/). For one
that does not (SmolLM2's ChatML), the tools are described in the system message with the format
to call them in (Hermes unless the gateway's --tool-call-parser chose another), which is what
the gateway's parser reads back; earlier calls and their results are written into the turns in
the same format.
"""
from __future__ import annotations

import json
from typing import Any

from services.common.tool_formats.base import Call, ToolFormat
from services.common.tool_formats.registry import DEFAULT, detect


def template_takes_tools(source: str | None) -> bool:
    return bool(source) and "tools" in source


def native_format(source: str | None) -> str:
    """The format a template writes tool calls in; the default for one that takes no tools."""
    return detect(source) if template_takes_tools(source) else DEFAULT


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: ToolFormat
                 ) -> list[dict[str, Any]]:
    """messages with the tools in the system message and tool calls/results as text in `fmt`."""
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    preamble = ("You can call functions. The available functions are listed in <tools></tools>:\n"
                f"<tools>\n{described}\n</tools>\n{fmt.call_instructions}")
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{preamble}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": preamble})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            written = fmt.write_calls([_call(c) for c in calls])
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + [written])
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = fmt.write_result(m.get("content") or "")
        if m.get("content") is None:
            m["content"] = ""
    return out


def _call(call: dict[str, Any]) -> Call:
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # kept as the string the client sent
    return Call(fn.get("name"), args)
