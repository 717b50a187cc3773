"""The Responses API (`POST /v1/responses`) as a view of chat completions.

A Responses request becomes the chat request the gateway already serves (`to_chat`): `input`
items → messages (`function_call` → an assistant message's tool_calls, `function_call_output`
→ a tool message), `instructions` → a leading system message, `text.format` →
`response_format`, flat function `tools` → chat's nested ones, `max_output_tokens` →
`max_tokens`. openai_protocol.parse_chat then validates and plans it (tools.py, structured.py);
`chat_param` renames the parameters its errors cite back to the Responses names. The chat
output comes back as Responses output items through `OutputBuilder`, which also yields the
stream events that build them, so a streamed and a whole response carry the same items.
"""
from __future__ import annotations

import json
import time
import uuid

from services.gateway import schemas
from services.gateway.errors import invalid

_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"},
    "annotations": {"type": "array"}, "logprobs": {"type": ["array", "null"]}}}
_MESSAGE = {"type": "object", "additionalProperties": False, "required": ["role", "content"], "properties": {
    "type": {"enum": ["message"]}, "id": {"type": "string"}, "status": {"type": "string"},
    "role": {"enum": ["user", "assistant", "system", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART, "maxItems": 64}]}}}
_FUNCTION_CALL = {"type": "object", "additionalProperties": False, "required": ["type", "call_id", "name", "arguments"],
                  "properties": {"type": {"enum": ["function_call"]}, "id": {"type": "string"},
                                 "status": {"type": "string"}, "call_id": {"type": "string", "minLength": 1},
                                 "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}}}
_CALL_OUTPUT = {"type": "object", "additionalProperties": False, "required": ["type", "call_id", "output"],
                "properties": {"type": {"enum": ["function_call_output"]}, "id": {"type": ["string", "null"]},
                               "status": {"type": ["string", "null"]},
                               "call_id": {"type": "string", "minLength": 1}, "output": {"type": "string"}}}
_FORMAT = {"anyOf": [
    {"type": "object", "additionalProperties": False, "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "additionalProperties": False, "required": ["type", "name", "schema"], "properties": {
        "type": {"enum": ["json_schema"]}, "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "schema": {"type": "object"}, "description": {"type": ["string", "null"]}, "strict": schemas.BOOL}},
]}
_TOOL = {"type": "object", "additionalProperties": False, "required": ["type", "name"], "properties": {
    "type": {"enum": ["function"]}, "name": {"type": "string", "minLength": 1, "maxLength": 64},
    "description": {"type": ["string", "null"]}, "parameters": {"type": ["object", "null"]}, "strict": schemas.BOOL}}
_NAMED_CHOICE = {"type": "object", "additionalProperties": False, "required": ["type", "name"],
                 "properties": {"type": {"enum": ["function"]}, "name": {"type": "string"}}}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
             "repetition_penalty")

RESPONSES_REQUEST = {
    "type": "object", "additionalProperties": False, "required": ["model", "input"],
    "properties": {
        **{k: schemas.OPENAI_SAMPLING[k] for k in ("model", *_SAMPLING)},
        "input": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 1024,
                                                                  "items": {"anyOf": [_MESSAGE, _FUNCTION_CALL,
                                                                                      _CALL_OUTPUT]}}]},
        "instructions": {"type": ["string", "null"], "description": "a system message; not carried over by "
                                                                     "previous_response_id"},
        "max_output_tokens": schemas.OPENAI_SAMPLING["max_tokens"],
        "text": {"type": ["object", "null"], "additionalProperties": False, "properties": {"format": _FORMAT}},
        "tools": {"type": ["array", "null"], "items": _TOOL, "maxItems": 128},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, _NAMED_CHOICE]},
        "parallel_tool_calls": schemas.BOOL,
        "store": {**schemas.BOOL, "description": "keep it for GET and previous_response_id (default true)"},
        "stream": schemas.BOOL,
        "previous_response_id": {"type": ["string", "null"], "minLength": 1},
        "metadata": {"type": ["object", "null"], "maxProperties": 16},
        "user": {"type": ["string", "null"]},
    },
}

# chat parameter (a prefix of the param an error names) → the Responses parameter
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}


def chat_param(param: str | None) -> str | None:
    if not param:
        return param
    for chat, ours in _PARAMS.items():
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours
    return param.replace(".function.", ".") if param.startswith("tools[") else param


def validated(body: dict) -> dict:
    try:
        return schemas.check(RESPONSES_REQUEST, body)
    except schemas.SchemaError as e:
        raise invalid(e.message, param=e.param or None) from None


def input_messages(body: dict) -> list[dict]:
    """`input` → chat messages (instructions not included). Consecutive function_call items
    make one assistant message; a function_call_output a tool message."""
    items = body["input"]
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def to_chat(body: dict, history: list[dict], messages: list[dict]) -> dict:
    """The chat completions body: `history` (a previous response's conversation), then the
    instructions, then `messages` (this request's input)."""
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat = {"model": body["model"], "messages": [*system, *history, *messages]}
    for key in _SAMPLING:
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None and fmt["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt["type"]}
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(rid: str, body: dict, model: str, status: str = "in_progress") -> dict:
    """The Response with no output yet; `finish` fills in output, usage and the final status."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    choice = body.get("tool_choice") or ("auto" if body.get("tools") else "none")
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "text": {"format": fmt},
            "tool_choice": choice, "tools": body.get("tools") or [], "store": body.get("store") is not False,
            "metadata": body.get("metadata") or {}, "usage": None}


def finish(response: dict, items: list[dict], usage: dict, finish_reason: str, cancelled: bool) -> None:
    """Completes `response` in place: completed, incomplete (max_output_tokens) or cancelled."""
    status = "cancelled" if cancelled else "incomplete" if finish_reason in ("length", "abort") else "completed"
    for item in items:
        item["status"] = "completed" if status == "completed" else "incomplete"
    response.update(status=status, output=items, usage={
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"]})
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens" if finish_reason == "length" else "aborted"}


def assistant_message(items: list[dict]) -> dict:
    """The output items as the chat conversation's assistant turn (for previous_response_id)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


class OutputBuilder:
    """Chat deltas ({"content": ...} or {"tool_calls": [...]}, as tools.ToolCallStream gives
    them) → Responses output items, and the stream events (without sequence_number) that
    build them: a message item with one output_text part, or a function_call item per call."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._close()
                events += self._add({"id": new_id("msg"), "type": "message", "role": "assistant",
                                     "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self._open["content"].append(part)
                events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                               "part": dict(part)})
            self._open["content"][0]["text"] += delta["content"]
            events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                           "delta": delta["content"], "logprobs": []})
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a new call: its header
                events += self._close()
                events += self._add({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                     "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
            args = call["function"].get("arguments", "")
            if args and self._open is not None:
                self._open["arguments"] += args
                events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": args})
        return events

    def close(self) -> list[dict]:
        return self._close()

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _close(self) -> list[dict]:
        item = self._open
        if item is None:
            return []
        events, where = [], self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        item["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": json.loads(json.dumps(item))})
        self._open = None
        return events
