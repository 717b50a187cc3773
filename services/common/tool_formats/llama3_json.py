"""Llama 3.1/3.2 JSON tool calls: `{"name": "fn", "parameters": {...}}`, several separated by `;`,
maybe after `<|python_tag|>` (a special token: present only when special tokens are not skipped).
"arguments" is read as a synonym of "parameters".

Any `{"name"` in the text starts a candidate; it is a call only when the whole object parses and
has a name and parameters, otherwise it stays content. A call is decided once something other
than whitespace or a `;` follows it (or the text ends), so the separator never reaches content.
"""
from __future__ import annotations

import re

from services.common.tool_formats.base import (Call, Segment, call_from, call_object, dumps, json_end, json_tag,
                                               loads, openai_call_id, scan_markers)

PYTHON_TAG, OBJECT = "<|python_tag|>", '{"name"'
_SEPARATOR = re.compile(r"\s*(?:;\s*)?")


class Llama3Json:
    name = "llama3_json"
    # 3.1 and 3.2 templates announce tools with "Environment: ipython" and answer as ipython.
    template_markers = (PYTHON_TAG, "Environment: ipython", "<|start_header_id|>ipython")
    call_instructions = ('To call functions, answer with only one JSON object per call, separated by "; ":\n'
                         '{"name": <function name>, "parameters": <arguments as a JSON object>}')

    def structural_tag(self, tools: list[tuple[str, dict]]) -> dict:
        # The trigger stops before the space, so a compact `{"name":"` gets the canonical layout.
        return {"type": "triggered_tags", "triggers": ['{"name":'], "at_least_one": False, "stop_after_first": False,
                "tags": [json_tag(f'{{"name": {dumps(name)}, "parameters": ', params, "}") for name, params in tools]}

    def scan(self, text: str, final: bool) -> tuple[list[Segment], str]:
        return scan_markers(text, final, (PYTHON_TAG, OBJECT), _read)

    def call_id(self) -> str:
        return openai_call_id()

    def write_calls(self, calls: list[Call]) -> str:
        return "; ".join(dumps(call_object(c, "parameters")) for c in calls)

    def write_result(self, content: str) -> str:
        return content


def _read(text: str, final: bool) -> tuple[list[Segment], int] | None:
    start = 0
    if text.startswith(PYTHON_TAG):
        body = text[len(PYTHON_TAG):].lstrip()
        if not body.startswith(OBJECT):
            if OBJECT.startswith(body) and not final:
                return None  # a call may still follow the tag
            return [PYTHON_TAG], len(PYTHON_TAG)
        start = len(text) - len(body)
    end = json_end(text, start)
    if end is None:
        return None
    call = call_from(loads(text[start:end]), "parameters")
    if call is None:
        return [text[:end]], end
    used = _SEPARATOR.match(text, end).end()
    if used == len(text) and not final:
        return None  # a ";" and the next call may follow
    return [call], used
