"""What a tool-call format is, and the scanning the formats share.

A format (one file each, listed in registry.py) says how a model writes function calls in its
text and owns everything that depends on it:
- `structural_tag(tools)`: the `format` of an xgrammar structural tag for tool_choice auto:
  free text, and after each trigger one call naming a tool, its arguments valid for its schema.
- `scan(text, final)`: text → (segments decided: text outside calls and `Call`s, the tail not
  decided yet because it may begin or continue a call). Scanning a prefix, then the tail plus
  the rest, decides what scanning the whole text does, so a stream fed in any pieces gives the
  calls of the finished text. With `final` nothing is left undecided.
- `template_markers`: strings whose presence in a chat template's source says it writes this format.
- `call_id()`: the id a parsed call gets (some templates check the ids sent back to them).
- for a template that does not render tools (services/tokenizer/tool_prompt.py): how to ask
  for calls (`call_instructions`), how an earlier turn's calls read (`write_calls`), and how a
  tool's result reads (`write_result`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

@dataclass(frozen=True)
class Call:
    name: str
    arguments: Any  # the JSON value the model wrote (a string is kept as the model's text)


Segment = str | Call
# A candidate call at the start of the text → (segments, characters consumed), or None while
# more text may change the decision. It always consumes something once it decides.
Reader = Callable[[str, bool], tuple[list[Segment], int] | None]


class ToolFormat(Protocol):
    name: str
    template_markers: tuple[str, ...]
    call_instructions: str

    def structural_tag(self, tools: list[tuple[str, dict]]) -> dict:
        """(name, parameters schema) per tool → the structural tag's `format` object."""

    def scan(self, text: str, final: bool) -> tuple[list[Segment], str]:
        """See the module docstring."""

    def call_id(self) -> str: ...

    def write_calls(self, calls: list[Call]) -> str: ...

    def write_result(self, content: str) -> str: ...


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_markers(text: str, final: bool, markers: tuple[str, ...], read: Reader) -> tuple[list[Segment], str]:
    """The shared loop of `scan`: text before the first marker is content (except a tail that
    may still become a marker), and `read` decides what starts at each marker."""
    out: list[Segment] = []
    while True:
        at = min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)
        if at < 0:
            cut = len(text) - (0 if final else partial_suffix(text, markers))
            _content(out, text[:cut])
            return out, text[cut:]
        _content(out, text[:at])
        text = text[at:]
        got = read(text, final)
        if got is None:  # needs more text; at the end, what is left was not a call
            if final:
                _content(out, text)
                text = ""
            return out, text
        segments, used = got
        out.extend(segments)
        text = text[used:]


def _content(out: list[Segment], text: str) -> None:
    if text:
        out.append(text)


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at text[start] (brackets counted outside
    strings), None when it is not closed yet. Whether it is valid JSON is json.loads's call."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def loads(text: str) -> Any:
    """json.loads, None for text that is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_from(obj: Any, args_key: str = "arguments", args_optional: bool = False) -> Call | None:
    """{"name": str, args_key or its synonym: {...}} → a Call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    synonym = "parameters" if args_key == "arguments" else "arguments"
    key = args_key if args_key in obj else synonym
    if key not in obj and not args_optional:
        return None
    return Call(obj["name"], obj.get(key, {}))


def call_object(call: Call, args_key: str = "arguments") -> dict:
    return {"name": call.name, args_key: call.arguments}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def json_tag(begin: str, params: dict, end: str) -> dict:
    """A structural-tag `tag` whose content is a JSON value valid for `params`."""
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": params}, "end": end}
