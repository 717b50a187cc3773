"""OpenAI tool calling: the request's tools → a constraint, the output → tool_calls.

Modes (`tool_choice`):
- `none`: the tools are not shown to the model; plain text.
- `auto` (the default with tools): the chat template shows the tools; the model may answer in
  text or call them in the Hermes format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`. A structural tag constrains only what follows `<tool_call>`: the name is one of
  the tools and the arguments validate against its schema.
- `required`: the whole output is one call, `{"name": ..., "arguments": {...}}`, constrained to
  the tools' schemas, so it works with any model.
- a named function: the whole output is that function's arguments object, constrained.

`ToolCallStream` turns a choice's text deltas into OpenAI's `delta.tool_calls` chunks (index,
id, name, then argument fragments), as the OpenAI SDK assembles them.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.grammar.constraint import STRUCTURAL_TAG, Constraint, json_schema
from services.gateway.errors import invalid

ANY_OBJECT: dict = {"type": "object"}
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolPlan:
    mode: str  # auto | required | named
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}]
    name: str | None = None  # the named function

    def params(self, name: str) -> dict:
        return next(t["function"].get("parameters") or ANY_OBJECT for t in self.tools
                    if t["function"]["name"] == name)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def constraint(self) -> Constraint:
        if self.mode == "named":
            return json_schema(self.params(self.name))
        if self.mode == "required":
            return json_schema({"anyOf": [_call_schema(n, self.params(n)) for n in self.names]})
        return Constraint(STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [CALL_BEGIN], "at_least_one": False, "stop_after_first": False,
            "tags": [{"type": "tag", "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(n)}, "arguments": ',
                      "content": {"type": "json_schema", "json_schema": self.params(n)},
                      "end": f"}}\n{CALL_END}"} for n in self.names]}}))


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(body: dict) -> ToolPlan | None:
    """None when the request has no tools or tool_choice none. Raises APIError(400)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must have distinct function names", param="tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise invalid(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
        return ToolPlan("named", tools, name)
    if choice == "required" and not tools:
        raise invalid('tool_choice "required" needs tools', param="tool_choice")
    if not tools or choice == "none":
        return None
    return ToolPlan("required" if choice == "required" else "auto", tools)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any, index: int) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A finished choice's text → (content, tool_calls). Unparseable text stays content."""
    if plan.mode == "named":
        return None, [_call(plan.name, text, 0)]
    if plan.mode == "required":
        try:
            obj = json.loads(text)
            return None, [_call(obj["name"], obj["arguments"], 0)]
        except (ValueError, KeyError, TypeError):
            return text, []
    calls, kept = [], []
    last = 0
    for m in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            call = _call(obj["name"], obj.get("arguments", obj.get("parameters", {})), len(calls))
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


@dataclass
class ToolCallStream:
    """One choice's streamed text → OpenAI delta objects ({"content": ...} or {"tool_calls": [...]})."""
    plan: ToolPlan
    _buffer: str = ""
    _started: bool = False  # the first tool call's header was sent (named / required)
    _count: int = 0  # tool calls sent (auto)
    _held: str = ""  # required: the one character held back (the wrapper's closing brace)

    def feed(self, text: str) -> list[dict]:
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required(text)
        return self._auto(text)

    def finish(self) -> list[dict]:
        """What is left at the end (auto: text that turned out not to be a call)."""
        if self.plan.mode == "auto" and self._buffer:
            out, self._buffer = [{"content": self._buffer}], ""
            return out
        return []

    @property
    def called(self) -> bool:
        return self._started or self._count > 0

    def _header(self, name: str, index: int) -> dict:
        return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _named(self, text: str) -> list[dict]:
        out = []
        if not self._started:
            self._started = True
            out.append(self._header(self.plan.name, 0))
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _required(self, text: str) -> list[dict]:
        out = []
        if not self._started:
            self._buffer += text
            m = re.match(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ', self._buffer)
            if m is None:
                return out
            self._started = True
            out.append(self._header(json.loads(m.group(1)), 0))
            text, self._buffer = self._buffer[m.end():], ""
        text = self._held + text
        self._held, text = text[-1:], text[:-1]  # the last "}" closes the wrapper, not the arguments
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _auto(self, text: str) -> list[dict]:
        self._buffer += text
        out = []
        while self._buffer:
            start = self._buffer.find(CALL_BEGIN)
            if start < 0:  # plain text, except a tail that may begin a call
                keep = _partial_prefix(self._buffer, CALL_BEGIN)
                head, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if head:
                    out.append({"content": head})
                break
            if start:
                out.append({"content": self._buffer[:start]})
                self._buffer = self._buffer[start:]
            end = self._buffer.find(CALL_END)
            if end < 0:
                break  # inside a call: wait for its end
            block, self._buffer = self._buffer[:end + len(CALL_END)], self._buffer[end + len(CALL_END):]
            _, calls = parse_output(self.plan, block)
            if calls:
                call = {**calls[0], "index": self._count}
                self._count += 1
                out.append({"tool_calls": [call]})
            else:
                out.append({"content": block})
        return out


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
