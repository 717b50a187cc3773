"""OpenAI tool calling: the request's tools → a constraint, the output → tool_calls.

Modes (`tool_choice`):
- `none`: the tools are not shown to the model; plain text.
- `auto` (the default with tools): the chat template shows the tools; the model may answer in
  text or call them in the plan's tool-call format (services/common/tool_formats/: Hermes
  `<tool_call>` blocks, Llama 3 JSON, Mistral `[TOOL_CALLS]`). The format's structural tag
  constrains only what follows its trigger: the name is one of the tools and the arguments
  validate against its schema.
- `required`: the whole output is one call, `{"name": ..., "arguments": {...}}`, constrained to
  the tools' schemas, so it works with any model.
- a named function: the whole output is that function's arguments object, constrained.

`ToolCallStream` turns a choice's text deltas into OpenAI's `delta.tool_calls` chunks (index,
id, name, then argument fragments), as the OpenAI SDK assembles them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.common.grammar.constraint import STRUCTURAL_TAG, Constraint, json_schema
from services.common.tool_formats.base import Call, Segment, ToolFormat
from services.common.tool_formats.registry import tool_format
from services.gateway.errors import invalid

ANY_OBJECT: dict = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # auto | required | named
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}]
    name: str | None = None  # the named function
    format: ToolFormat = field(default_factory=lambda: tool_format(""))  # how calls read in the text (auto)

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
        tag = self.format.structural_tag([(n, self.params(n)) for n in self.names])
        return Constraint(STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": tag}))

    def call(self, name: str, arguments: Any, index: int) -> dict:
        """One OpenAI tool call, its id the format's."""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return {"index": index, "id": self.format.call_id(), "type": "function",
                "function": {"name": name, "arguments": args}}


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(body: dict, format_name: str = "") -> ToolPlan | None:
    """None when the request has no tools or tool_choice none. `format_name`: the tool-call
    format of auto ("" = the default). Raises APIError(400)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must have distinct function names", param="tools")
    fmt = tool_format(format_name)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise invalid(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
        return ToolPlan("named", tools, name, fmt)
    if choice == "required" and not tools:
        raise invalid('tool_choice "required" needs tools', param="tool_choice")
    if not tools or choice == "none":
        return None
    return ToolPlan("required" if choice == "required" else "auto", tools, format=fmt)


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A finished choice's text → (content, tool_calls). Unparseable text stays content."""
    if plan.mode == "named":
        return None, [plan.call(plan.name, text, 0)]
    if plan.mode == "required":
        try:
            obj = json.loads(text)
            return None, [plan.call(obj["name"], obj["arguments"], 0)]
        except (ValueError, KeyError, TypeError):
            return text, []
    segments, _ = plan.format.scan(text, final=True)
    calls = [plan.call(c.name, c.arguments, i) for i, c in enumerate(s for s in segments if isinstance(s, Call))]
    content = "".join(s for s in segments if isinstance(s, str)).strip() if calls else text
    return content or None, calls


@dataclass
class ToolCallStream:
    """One choice's streamed text → OpenAI delta objects ({"content": ...} or {"tool_calls": [...]})."""
    plan: ToolPlan
    _buffer: str = ""  # auto: text not decided yet (it may begin a call); required: text before the header
    _started: bool = False  # the first tool call's header was sent (named / required)
    _count: int = 0  # tool calls sent (auto)
    _held: str = ""  # required: the one character held back (the wrapper's closing brace)

    def feed(self, text: str) -> list[dict]:
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required(text)
        return self._auto(text, final=False)

    def finish(self) -> list[dict]:
        """What is left at the end (auto: text that turned out not to be a call)."""
        return self._auto("", final=True) if self.plan.mode == "auto" else []

    @property
    def called(self) -> bool:
        return self._started or self._count > 0

    def _header(self, name: str, index: int) -> dict:
        return {"tool_calls": [self.plan.call(name, "", index)]}

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

    def _auto(self, text: str, final: bool) -> list[dict]:
        segments, self._buffer = self.plan.format.scan(self._buffer + text, final)
        return [self._delta(s) for s in segments]

    def _delta(self, segment: Segment) -> dict:
        if isinstance(segment, str):
            return {"content": segment}
        self._count += 1
        return {"tool_calls": [self.plan.call(segment.name, segment.arguments, self._count - 1)]}
