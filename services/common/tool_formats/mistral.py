"""Mistral (7B v0.3, Nemo, Small 3.0/3.1 templates): `[TOOL_CALLS][{"name": "fn", "arguments":
{...}}, ...]`, one JSON list of calls after the `[TOOL_CALLS]` token.

`[TOOL_CALLS]` is a special token in Mistral's tokenizers: the text loses it when special tokens
are skipped (the default), and a grammar masks special tokens. So the bare list `[{"name": ...}]`
counts as calls too, and the structural tag triggers on either. The list is a call only when all
of it parses and every item has a name and arguments; otherwise it stays content.
"""
from __future__ import annotations

import uuid

from services.common.tool_formats.base import (Call, Segment, call_from, call_object, dumps, json_end, json_tag,
                                               loads, scan_markers)

TOOL_CALLS, LIST = "[TOOL_CALLS]", '[{"name"'


class Mistral:
    name = "mistral"
    template_markers = (TOOL_CALLS, "[AVAILABLE_TOOLS]")
    call_instructions = ("To call functions, answer with [TOOL_CALLS] and a JSON list of the calls:\n"
                         '[TOOL_CALLS][{"name": <function name>, "arguments": <arguments as a JSON object>}]')

    def structural_tag(self, tools: list[tuple[str, dict]]) -> dict:
        return {"type": "triggered_tags", "triggers": [TOOL_CALLS, '[{"name":'], "at_least_one": False,
                "stop_after_first": False,
                "tags": [_list_tag(opening, name, params, tools) for opening in (TOOL_CALLS + "[", "[")
                         for name, params in tools]}

    def scan(self, text: str, final: bool) -> tuple[list[Segment], str]:
        return scan_markers(text, final, (TOOL_CALLS, LIST), _read)

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates refuse ids that are not 9 letters or digits

    def write_calls(self, calls: list[Call]) -> str:
        return TOOL_CALLS + dumps([call_object(c) for c in calls])

    def write_result(self, content: str) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"


def _call_begin(name: str) -> str:
    return f'{{"name": {dumps(name)}, "arguments": '


def _list_tag(opening: str, name: str, params: dict, tools: list[tuple[str, dict]]) -> dict:
    """`opening` and a list whose first call is `name`'s, then any calls after ", ", then "]"."""
    more = {"type": "sequence", "elements": [
        {"type": "const_string", "value": ", "},
        {"type": "or", "elements": [json_tag(_call_begin(n), p, "}") for n, p in tools]}]}
    return {"type": "tag", "begin": opening + _call_begin(name), "end": "]", "content": {
        "type": "sequence", "elements": [{"type": "json_schema", "json_schema": params},
                                         {"type": "const_string", "value": "}"},
                                         {"type": "star", "content": more}]}}


def _read(text: str, final: bool) -> tuple[list[Segment], int] | None:
    start = 0
    if text.startswith(TOOL_CALLS):
        body = text[len(TOOL_CALLS):].lstrip()
        if not body.startswith("["):
            return None if not body and not final else ([TOOL_CALLS], len(TOOL_CALLS))
        start = len(text) - len(body)
    end = json_end(text, start)
    if end is None:
        return None
    items = loads(text[start:end])
    calls = [call_from(item) for item in items] if isinstance(items, list) and items else [None]
    if any(c is None for c in calls):
        return [text[:end]], end
    return calls, end
