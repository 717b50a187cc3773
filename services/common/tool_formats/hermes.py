"""Hermes (Qwen 2.5/3, Hermes 2/3, SmolLM3, and what the tokenizer inlines for a template without
tools): one block per call, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
from __future__ import annotations

from services.common.tool_formats.base import (Call, Segment, call_from, call_object, dumps, json_tag, loads,
                                               openai_call_id, scan_markers)

BEGIN, END = "<tool_call>", "</tool_call>"


class Hermes:
    name = "hermes"
    template_markers = (BEGIN,)
    call_instructions = ("To call a function, answer with one <tool_call></tool_call> block per call:\n"
                         '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
                         "</tool_call>")

    def structural_tag(self, tools: list[tuple[str, dict]]) -> dict:
        return {"type": "triggered_tags", "triggers": [BEGIN], "at_least_one": False, "stop_after_first": False,
                "tags": [json_tag(f'{BEGIN}\n{{"name": {dumps(name)}, "arguments": ', params, f"}}\n{END}")
                         for name, params in tools]}

    def scan(self, text: str, final: bool) -> tuple[list[Segment], str]:
        return scan_markers(text, final, (BEGIN,), _read)

    def call_id(self) -> str:
        return openai_call_id()

    def write_calls(self, calls: list[Call]) -> str:
        return "\n".join(f"{BEGIN}\n{dumps(call_object(c))}\n{END}" for c in calls)

    def write_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _read(text: str, final: bool) -> tuple[list[Segment], int] | None:
    end = text.find(END)
    if end < 0:
        return None
    used = end + len(END)
    call = call_from(loads(text[len(BEGIN):end].strip()), args_optional=True)
    return [call or text[:used]], used
