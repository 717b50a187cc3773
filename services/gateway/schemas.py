"""Request schemas (JSON Schema, the OpenAPI 3.1 dialect) and the checker that enforces them.

One source of truth: openapi.py publishes these dicts and openai_protocol.py
validates request bodies with `check`, so what a fuzzer generates from the
document and what the gateway accepts cannot drift apart. Rules a schema cannot
state (top_logprobs needs logprobs, min_tokens <= max_tokens, ids below the
vocabulary size) are checked in openai_protocol.py after `check`.

`check` implements the subset used here: type (incl. lists and "null"), enum,
minimum/maximum/exclusiveMinimum, minLength/maxLength, items, minItems/maxItems,
properties/required/additionalProperties (bool), maxProperties, anyOf, oneOf. Numbers
must be finite; an integral float counts as an integer (as JSON Schema says).
"""
from __future__ import annotations

import math
from typing import Any

from services.common.request_limits import (  # shared with the tokenizer's gRPC door
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_RID_CHARS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class SchemaError(ValueError):
    def __init__(self, param: str, message: str, wrong_type: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.wrong_type = wrong_type  # the value's type was wrong (not a constraint)


def nullable(schema: dict) -> dict:
    t = schema["type"]
    return {**schema, "type": [*(t if isinstance(t, list) else [t]), "null"]}


def _int(lo: int, hi: int, **kw: Any) -> dict:
    return {"type": ["integer", "null"], "minimum": lo, "maximum": hi, **kw}


def _num(lo: float, hi: float | None = None, *, exclusive_lo: bool = False, **kw: Any) -> dict:
    s: dict = {"type": ["number", "null"], ("exclusiveMinimum" if exclusive_lo else "minimum"): lo, **kw}
    if hi is not None:
        s["maximum"] = hi
    return s


BOOL = {"type": ["boolean", "null"]}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
             "minItems": 1}
STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
                  {"type": "null"}],
        "description": "up to 16 strings; generation stops before the first one (not included in the text)"}
STOP_TOKEN_IDS = nullable({**TOKEN_IDS, "minItems": 0, "maxItems": MAX_STOP_TOKEN_IDS})

# Sampling controls shared by /v1/completions and /v1/chat/completions.
OPENAI_SAMPLING = {
    "model": {"type": "string", "description": "the served model's name (GET /v1/models)"},
    "max_tokens": _int(1, INT32_MAX, description="tokens to generate at most; prompt + max_tokens must fit the "
                                                 "context; default: what the context leaves after the prompt"),
    "max_completion_tokens": _int(1, INT32_MAX, description="the newer name of max_tokens; wins when both are given"),
    "temperature": _num(0, 2, description="0 = greedy"),
    "top_p": _num(0, 1, exclusive_lo=True),
    "top_k": _int(-1, INT32_MAX, description="-1 or 0 disables"),
    "min_p": _num(0, 1),
    "frequency_penalty": _num(-2, 2),
    "presence_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, MAX_REPETITION_PENALTY, exclusive_lo=True, description="1 = none"),
    "seed": _int(0, INT64_MAX),
    "n": _int(1, MAX_N, description="completions to generate for each prompt"),
    "stop": STOP,
    "stop_token_ids": STOP_TOKEN_IDS,
    "ignore_eos": BOOL,
    "min_tokens": _int(0, INT32_MAX, description="EOS and stops are ignored before this many tokens"),
    "skip_special_tokens": BOOL,
    "include_stop_str_in_output": BOOL,
    "stream": BOOL,
    "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                       "properties": {"include_usage": BOOL}},
    "user": {"type": ["string", "null"]},
    # Structured outputs beyond response_format (vLLM's and SGLang's extras): at most one constraint.
    "regex": {"type": ["string", "null"], "minLength": 1, "description": "the output matches this regular expression"},
    "ebnf": {"type": ["string", "null"], "minLength": 1, "description": "the output is a sentence of this EBNF "
                                                                        "grammar (xgrammar's dialect, start rule root)"},
    "choice": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1}, "minItems": 1,
               "maxItems": 1024, "description": "the output is exactly one of these strings"},
    "structural_tag": {"type": ["object", "string", "null"],
                       "description": "an xgrammar structural tag (JSON): free text with constrained tagged parts"},
    # radixmesh's extra: opt out of speculative decoding (the output is the same; only the speed differs).
    "speculative": {**BOOL, "description": "false: this request never speculates, even when the server "
                                           "drafts; default true"},
}

_JSON_SCHEMA_FORMAT = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": ["string", "null"]},
        "schema": {"type": ["object", "null"], "description": "the JSON schema the output validates against"},
        "strict": BOOL,
    },
}
RESPONSE_FORMAT = {
    "type": ["object", "null"], "additionalProperties": False, "required": ["type"],
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": _JSON_SCHEMA_FORMAT},
    "description": "text, any JSON object (json_object), or JSON that validates against json_schema.schema",
}

COMPLETION_REQUEST = {
    "type": "object", "additionalProperties": False, "required": ["model", "prompt"],
    "properties": {
        **OPENAI_SAMPLING,
        "prompt": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 64},
            TOKEN_IDS,
            {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 64},
        ]},
        "logprobs": _int(0, MAX_TOP_LOGPROBS, description="return the log probabilities of this many most likely tokens"),
        "max_tokens": _int(0, INT32_MAX, description="tokens to generate at most (0: none, with echo: score the "
                                                     "prompt); default: what the context leaves after the prompt"),
        "echo": {**BOOL, "description": "the prompt (and with logprobs its tokens' logprobs, the first null) "
                                        "precedes the completion; not with stream"},
        "prompt_logprobs": _int(0, MAX_TOP_LOGPROBS, description="vLLM's: each prompt token's logprob and its "
                                                                 "top k (the first token: null); not with stream"),
        "best_of": _int(1, 1, description="only 1 (use n for several completions)"),
        "logit_bias": {"type": ["object", "null"], "maxProperties": 0, "description": "not supported"},
        "suffix": {"type": "null", "description": "not supported"},
        "response_format": RESPONSE_FORMAT,
    },
}

_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_TOOL_CALL = {
    "type": "object", "additionalProperties": False, "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["function"]},
        "function": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "maxItems": 64}]}
_NAME = {"type": ["string", "null"]}
CHAT_MESSAGE = {"anyOf": [
    {"type": "object", "additionalProperties": False, "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT, "name": _NAME}},
    {"type": "object", "additionalProperties": False, "required": ["role"],
     "description": "content may be null or left out when tool_calls is given",
     "properties": {"role": {"enum": ["assistant"]}, "content": {"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
                    "name": _NAME, "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL, "maxItems": 64}}},
    {"type": "object", "additionalProperties": False, "required": ["role", "content", "tool_call_id"],
     "properties": {"role": {"enum": ["tool"]}, "content": _CONTENT, "tool_call_id": {"type": "string"},
                    "name": _NAME}},
]}

TOOL = {
    "type": "object", "additionalProperties": False, "required": ["type", "function"],
    "properties": {
        "type": {"enum": ["function"]},
        "function": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON schema of the arguments object"},
            "strict": BOOL,
        }},
    },
}
_NAMED_TOOL_CHOICE = {
    "type": "object", "additionalProperties": False, "required": ["type", "function"],
    "properties": {"type": {"enum": ["function"]},
                   "function": {"type": "object", "additionalProperties": False, "required": ["name"],
                                "properties": {"name": {"type": "string"}}}},
}

CHAT_REQUEST = {
    "type": "object", "additionalProperties": False, "required": ["model", "messages"],
    "properties": {
        **OPENAI_SAMPLING,
        "messages": {"type": "array", "items": CHAT_MESSAGE, "minItems": 1, "maxItems": 1024},
        "logprobs": BOOL,
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS, description="needs logprobs=true"),
        "prompt_logprobs": _int(0, MAX_TOP_LOGPROBS, description="vLLM's: each prompt token's logprob and its "
                                                                 "top k, at the response's top level; not with stream"),
        "tools": {"type": ["array", "null"], "items": TOOL, "maxItems": 128},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, _NAMED_TOOL_CHOICE],
                        "description": "none, auto (default with tools), required (at least one call), or a "
                                       "named function; required and named are constrained to the tool's schema"},
        "parallel_tool_calls": BOOL,
        "response_format": RESPONSE_FORMAT,
        "logit_bias": {"type": ["object", "null"], "maxProperties": 0, "description": "not supported"},
    },
}

NATIVE_SAMPLING = {
    "type": ["object", "null"], "additionalProperties": False,
    "properties": {
        "max_new_tokens": _int(0, INT32_MAX, description="0: prefill only (input logprobs, the prompt cached)"),
        "min_new_tokens": _int(0, INT32_MAX),
        "temperature": _num(0, description="0 = greedy"),
        "top_p": _num(0, 1, exclusive_lo=True),
        "top_k": _int(-1, INT32_MAX),
        "min_p": _num(0, 1),
        "repetition_penalty": _num(0, MAX_REPETITION_PENALTY, exclusive_lo=True),
        "frequency_penalty": _num(-2, 2),
        "presence_penalty": _num(-2, 2),
        "seed": _int(0, INT64_MAX),
        "stop": STOP,
        "stop_token_ids": STOP_TOKEN_IDS,
        "ignore_eos": BOOL,
        "skip_special_tokens": BOOL,
        "include_stop_str_in_output": BOOL,
        "n": _int(1, MAX_N),
        "json_schema": {"type": ["string", "null"], "minLength": 1, "description": "the output validates against "
                                                                                "this JSON schema (a JSON string)"},
        "regex": OPENAI_SAMPLING["regex"],
        "ebnf": OPENAI_SAMPLING["ebnf"],
        "choice": OPENAI_SAMPLING["choice"],
        "structural_tag": OPENAI_SAMPLING["structural_tag"],
        "speculative": OPENAI_SAMPLING["speculative"],
        "spaces_between_special_tokens": {**BOOL, "description": "SGLang's; accepted, changes nothing"},
        "stop_regex": {"type": ["array", "null"], "maxItems": 0, "description": "SGLang's; only null or [] (unsupported)"},
    },
}

GENERATE_REQUEST = {
    "type": "object", "additionalProperties": False,
    "description": "exactly one of text and input_ids",
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    "properties": {
        "text": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                            "maxItems": 64}], "description": "a prompt, or a batch of them (answered as a list)"},
        "input_ids": {"anyOf": [TOKEN_IDS, {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 64}]},
        "return_text_in_logprobs": {**BOOL, "description": "SGLang's; logprob entries always carry the text"},
        "sampling_params": NATIVE_SAMPLING,
        "stream": BOOL,
        "return_logprob": BOOL,
        "top_logprobs_num": _int(0, MAX_TOP_LOGPROBS),
        "logprob_start_len": _int(-1, INT32_MAX, description="with return_logprob: input logprobs from this "
                                                             "prompt position on; -1 (default): none"),
        "rid": {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_RID_CHARS},
        "adapter": {"type": ["string", "null"], "maxLength": 256,
                    "description": "a loaded LoRA adapter's name (GET /v1/models); none: the base model"},
        "lora_path": {"type": ["string", "null"], "maxLength": 256, "description": "SGLang's name for adapter"},
    },
}


_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and math.isfinite(v) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_ARTICLE = {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}


def _type_ok(schema: dict, value: Any) -> bool:
    types = schema.get("type")
    if types is None:
        return True
    return any(_TYPES[t](value) for t in (types if isinstance(types, list) else [types]))


def _kind(schema: dict) -> str:
    """'a string', 'an array of integers', ... for messages."""
    types = schema.get("type")
    if types is None:
        return f"one of {schema.get('enum')}"
    if types == "array" and "items" in schema:
        head, _, tail = _kind(schema["items"]).split(" ", 1)[1].partition(" ")
        return f"an array of {head}s{' ' + tail if tail else ''}"
    return _describe(types if isinstance(types, list) else [types])


def _describe(types: list[str]) -> str:
    return " or ".join(_ARTICLE.get(t, f"a {t}") for t in types)


def check(schema: dict, value: Any, path: str = "") -> Any:
    """Raise SchemaError(param=path) unless `value` conforms; returns `value`
    with integral floats in integer fields turned into ints."""
    name = path or "the request body"
    if "anyOf" in schema:
        options, errors = schema["anyOf"], []
        for option in options:
            try:
                return check(option, value, path)
            except SchemaError as e:
                errors.append(e)
        # Options of the value's own type failed on a detail: report the one that got furthest.
        near = [e for o, e in zip(options, errors) if _type_ok(o, value)]
        if near:
            raise max(near, key=lambda e: (len(e.param), e.param, not e.wrong_type))
        raise SchemaError(path, f"{name} must be {' or '.join(map(_kind, options))}, got {_short(value)}")
    if "oneOf" in schema:
        passed = 0
        for option in schema["oneOf"]:
            try:
                check(option, value, path)
                passed += 1
            except SchemaError:
                pass
        if passed != 1:
            raise SchemaError(path, f"{name} must match exactly one of: {schema.get('description', schema['oneOf'])}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        raise SchemaError(path, f"{name} must be one of {schema['enum']}, got {_short(value)}")
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        matched = next((t for t in types if _TYPES[t](value)), None)
        if matched is None:
            raise SchemaError(path, f"{name} must be {_describe(types)}, got {_short(value)}", wrong_type=True)
        if matched == "integer" and isinstance(value, float):
            value = int(value)
        if matched == "number":
            try:
                if not math.isfinite(float(value)):
                    raise OverflowError
            except OverflowError:
                raise SchemaError(path, f"{name} must be a finite number") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(schema, value, name, path)
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise SchemaError(path, f"{name} must not be empty" if schema["minLength"] == 1
                              else f"{name} must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise SchemaError(path, f"{name} must have at most {schema['maxLength']} characters")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise SchemaError(path, f"{name} must not be empty" if schema["minItems"] == 1
                              else f"{name} must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise SchemaError(path, f"{name} must have at most {schema['maxItems']} items, got {len(value)}")
        if "items" in schema:
            value = [check(schema["items"], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        value = _check_object(schema, value, path, name)
    return value


def _check_range(schema: dict, value: float, name: str, path: str) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo = schema.get("exclusiveMinimum")
    if (lo is not None and value < lo) or (hi is not None and value > hi) or (xlo is not None and value <= xlo):
        left = f"({xlo}" if xlo is not None else (f"[{lo}" if lo is not None else "(-inf")
        right = f"{hi}]" if hi is not None else "inf)"
        raise SchemaError(path, f"{name} must be in {left}, {right}, got {_short(value)}")


def _check_object(schema: dict, value: dict, path: str, name: str) -> dict:
    props = schema.get("properties", {})
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        raise SchemaError(path, f"{name} is not supported" if schema["maxProperties"] == 0
                          else f"{name} has too many entries")
    checked = {k: check(props[k], v, f"{path}.{k}".lstrip(".")) if k in props else v for k, v in value.items()}
    for key in schema.get("required", []):
        if key not in value:
            raise SchemaError(f"{path}.{key}".lstrip("."), f"{f'{path}.{key}'.lstrip('.')} is required")
    if schema.get("additionalProperties", True) is False:
        unknown = [k for k in value if k not in props]
        if unknown:
            where = f" in {path}" if path else ""
            raise SchemaError(f"{path}.{unknown[0]}".lstrip("."),
                              f"unrecognized request argument{where}: {unknown[0]!r}")
    return checked


def _same(a: Any, b: Any) -> bool:
    """JSON equality: unlike Python's, false != 0 and true != 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return type(a) is type(b) and a == b


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
