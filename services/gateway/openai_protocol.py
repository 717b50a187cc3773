"""Request bodies → GenerateCalls with SamplingParams, with OpenAI's semantics.

Each parse_* function takes the decoded JSON body and the served names (the id first) and
returns a `ParsedRequest`, or raises APIError(400) with a message naming the
offending parameter. Order of checks: JSON shape against schemas.py (types,
ranges, unknown fields), then the model name, then rules that span fields,
then `SamplingParams.validate` as the last word of the core.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.request_limits import check_request_limits
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.gateway import schemas, sglang_compat
from services.gateway.backend import GenerateCall, ModelInfo
from services.gateway.errors import APIError, invalid
from services.gateway.structured import constraint_of
from services.gateway.tools import ToolPlan, plan_tools

# Fields that exist in OpenAI's API but not here: the reason replaces the schema's message.
_UNSUPPORTED = {
    "best_of": "best_of is not supported: use n to get several completions",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix is not supported",
}
MAX_SEQUENCES = 64  # prompts x n in one request


@dataclass
class ParsedRequest:
    kind: str  # completion | chat | generate
    id: str
    model: str
    calls: list[GenerateCall]  # one per prompt; choice index = prompt * n + sequence
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolPlan | None = None  # chat with tools: how the output becomes tool_calls
    # Prompt logprobs (docs/prompt_logprobs_and_embeddings.md): vLLM's prompt_logprobs (top k; -1 none),
    # legacy completions' echo, /generate's input logprobs (return_logprob with logprob_start_len >= 0).
    prompt_logprobs: int = -1
    echo: bool = False
    input_logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def decode_json(raw: bytes) -> dict:
    """Bytes → a JSON object; NaN/Infinity literals and non-objects are 400s."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:  # JSON may escape a lone UTF-16 surrogate ("\udc00"), which no UTF-8 string can carry
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(f"the request body contains {e.object[e.start:e.end]!r}, a lone UTF-16 surrogate, "
                      "which is not valid Unicode", code="invalid_json") from None
    return body


def _validated(schema: dict, body: dict) -> dict:
    try:
        return schemas.check(schema, body)
    except schemas.SchemaError as e:
        top = e.param.split(".")[0].split("[")[0]
        message = _UNSUPPORTED.get(top, e.message) if top in body else e.message
        raise invalid(message, param=e.param or None) from None


def model_not_found_message(name: str, served: Sequence[str]) -> str:
    return f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}"


def _check_model(body: dict, served: Sequence[str], info: ModelInfo) -> tuple[str, str]:
    """(the model id responses carry, the LoRA adapter): the served id (the first name) and no
    adapter when the body names a served name; the adapter's own name and the adapter when it
    names a loaded adapter (as vLLM); else model_not_found."""
    name = body["model"]
    if name in served:
        return served[0], ""
    if name in info.adapters:
        return name, name
    raise APIError(400, model_not_found_message(name, [*served, *info.adapters]), param="model",
                   code="model_not_found")


def _with_adapter(calls: list[GenerateCall], adapter: str) -> list[GenerateCall]:
    for call in calls:
        call.adapter = adapter
    return calls


def _fills_context(values: dict, fill: bool) -> bool:
    """OpenAI's default for a missing max_tokens: what the context leaves after the prompt."""
    return fill and values.get("max_tokens") is None


def _sampling(values: dict, info: ModelInfo, default_max_tokens: int | None,
              names: dict[str, str] | None = None, fill: bool = False) -> SamplingParams:
    """Sampling fields under their OpenAI names → SamplingParams. `names` maps
    a field to the parameter name the client used, for error messages. With
    `fill` (the OpenAI routes) a missing max_tokens is left to the backend, which
    gives what the context leaves (at most default_max_tokens); max_new_tokens
    then holds the most that can be, for the checks here. Without `fill`
    (/generate, as SGLang) it is default_max_tokens or the core's default."""
    names = names or {}

    def get(key: str, default: Any) -> Any:
        value = values.get(key)
        return default if value is None else value

    sp = SamplingParams()
    max_tokens = get("max_tokens", None)
    fills = _fills_context(values, fill)
    if fills:
        max_tokens = min(default_max_tokens or info.context_length, info.context_length - 1)
    elif max_tokens is None:
        max_tokens = default_max_tokens or sp.max_new_tokens
    stop = get("stop", [])
    sp = SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=get("min_tokens", 0),
        temperature=float(get("temperature", sp.temperature)),
        top_p=float(get("top_p", sp.top_p)),
        top_k=get("top_k", sp.top_k),
        min_p=float(get("min_p", sp.min_p)),
        repetition_penalty=float(get("repetition_penalty", sp.repetition_penalty)),
        frequency_penalty=float(get("frequency_penalty", sp.frequency_penalty)),
        presence_penalty=float(get("presence_penalty", sp.presence_penalty)),
        seed=get("seed", None),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(get("stop_token_ids", [])),
        ignore_eos=get("ignore_eos", False),
        speculative=get("speculative", sp.speculative),
    )
    max_name, min_name = names.get("max_tokens", "max_tokens"), names.get("min_tokens", "min_tokens")
    if fills and sp.min_new_tokens > sp.max_new_tokens:
        raise invalid(f"{min_name} ({sp.min_new_tokens}) must be <= {max_name}, which defaults to what the "
                      f"context leaves after the prompt (at most {sp.max_new_tokens})", param=min_name)
    if sp.max_new_tokens >= info.context_length and not fills:
        raise invalid(f"{max_name} ({sp.max_new_tokens}) leaves no room for the prompt: the model's context "
                      f"length is {info.context_length} tokens", param=max_name)
    if sp.min_new_tokens > sp.max_new_tokens:
        raise invalid(f"{min_name} ({sp.min_new_tokens}) must be <= {max_name} ({sp.max_new_tokens})",
                      param=min_name)
    bad = [t for t in sp.stop_token_ids if t >= info.vocab_size]
    if bad:
        raise invalid(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {info.vocab_size})",
                      param=names.get("stop_token_ids", "stop_token_ids"))
    return sp


def _finish_sampling(sp: SamplingParams, info: ModelInfo, logprobs: bool, top: int) -> SamplingParams:
    sp.logprobs, sp.top_logprobs = logprobs, top
    try:
        sp.validate(info.vocab_size)
    except InvalidRequest as e:
        raise invalid(str(e)) from None
    return sp


def _check_ids(ids: list[int], info: ModelInfo, param: str) -> None:
    bad = [t for t in ids if t >= info.vocab_size]
    if bad:
        raise invalid(f"token ids {bad[:5]} are outside the vocabulary [0, {info.vocab_size})", param=param)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    return stream, bool((options or {}).get("include_usage"))


def _calls(rid: str, sp: SamplingParams, n: int, prompts: list[dict], values: dict,
           fill_cap: int | None = None, fills: bool = False) -> list[GenerateCall]:
    """One call per prompt; `values` holds the detokenizer options; `fills`: max_tokens
    is left to the backend (see GenerateCall.fill_context)."""
    if len(prompts) * n > MAX_SEQUENCES:
        raise invalid(f"{len(prompts)} prompts x n={n} is more than {MAX_SEQUENCES} sequences in one request",
                      param="n")
    try:  # the schema said so already; this is the rule the gRPC door applies too
        check_request_limits(sp, n, rid)
    except InvalidRequest as e:
        raise invalid(str(e)) from None
    many = len(prompts) > 1
    skip = values.get("skip_special_tokens")
    options = {"skip_special_tokens": True if skip is None else skip,
               "include_stop_str_in_output": bool(values.get("include_stop_str_in_output"))}
    return [GenerateCall(f"{rid}-{i}" if many else rid, _copy(sp), n, **p, **options, fill_context=fills,
                         fill_cap=fill_cap if fills else None)
            for i, p in enumerate(prompts)]


def _copy(sp: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**vars(sp), "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids)})


def _max_tokens_alias(body: dict) -> tuple[dict, dict]:
    """(body with max_completion_tokens, the newer name, folded into max_tokens; the parameter
    names errors should cite). Both routes accept either name; the newer wins when both are given."""
    if body.get("max_completion_tokens") is None:
        return body, {}
    return {**body, "max_tokens": body["max_completion_tokens"]}, {"max_tokens": "max_completion_tokens"}


def parse_completion(body: dict, info: ModelInfo, served: Sequence[str], default_max_tokens: int | None = None
                     ) -> ParsedRequest:
    body = _validated(schemas.COMPLETION_REQUEST, body)
    model, adapter = _check_model(body, served, info)
    stream, include_usage = _stream_flags(body)
    n = body.get("n") or 1
    logprobs = body.get("logprobs")
    values, names = _max_tokens_alias(body)
    fills = _fills_context(values, True)
    sp = _finish_sampling(_sampling(values, info, default_max_tokens, names, fill=True), info,
                          logprobs is not None, logprobs or 0)
    sp.constraint = constraint_of(body)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [{"text": prompt}]
    elif isinstance(prompt[0], str):
        prompts = [{"text": p} for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [{"input_ids": prompt}]
    else:
        prompts = [{"input_ids": p} for p in prompt]
    for i, p in enumerate(prompts):
        if "input_ids" in p:
            _check_ids(p["input_ids"], info, "prompt")
            if fills and len(p["input_ids"]) >= info.context_length:
                raise invalid(f"the prompt ({len(p['input_ids'])} tokens) leaves no room for output within the "
                              f"model's context length of {info.context_length} tokens", param="prompt")
            if not fills and len(p["input_ids"]) + sp.max_new_tokens > info.context_length:
                raise invalid(f"prompt ({len(p['input_ids'])} tokens) + max_tokens ({sp.max_new_tokens}) exceeds "
                              f"the model's context length of {info.context_length} tokens", param="prompt")
    echo, prompt_logprobs = bool(body.get("echo")), body.get("prompt_logprobs")
    _ask_prompt_logprobs(sp, stream, echo, prompt_logprobs, logprobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    calls = _with_adapter(_calls(rid, sp, n, prompts, body, default_max_tokens, fills), adapter)
    return ParsedRequest("completion", rid, model, calls, n, stream, include_usage, logprobs is not None,
                         logprobs or 0, prompt_logprobs=-1 if prompt_logprobs is None else prompt_logprobs,
                         echo=echo)


def _ask_prompt_logprobs(sp: SamplingParams, stream: bool, echo: bool, prompt_logprobs: int | None,
                         logprobs: int | None) -> None:
    """Prompt logprobs from position 0 for echo (top `logprobs`) and vLLM's prompt_logprobs (top k): the
    larger k serves both (tops are most likely first)."""
    if not echo and prompt_logprobs is None:
        return
    if stream:
        raise invalid("echo and prompt_logprobs are not supported with stream", param="echo" if echo else
                      "prompt_logprobs")
    sp.prompt_logprobs = max(prompt_logprobs or 0, (logprobs or 0) if echo else 0)
    sp.logprob_start_len = 0


def parse_chat(body: dict, info: ModelInfo, served: Sequence[str], default_max_tokens: int | None = None
               ) -> ParsedRequest:
    body = _validated(schemas.CHAT_REQUEST, body)
    model, adapter = _check_model(body, served, info)
    if not info.has_chat_template:
        raise invalid(f"the model {model!r} has no chat template: use /v1/completions", param="messages")
    stream, include_usage = _stream_flags(body)
    n = body.get("n") or 1
    logprobs, top = bool(body.get("logprobs")), body.get("top_logprobs") or 0
    if top and not logprobs:
        raise invalid("top_logprobs requires logprobs=true", param="top_logprobs")
    values, names = _max_tokens_alias(body)
    fills = _fills_context(values, True)
    sp = _finish_sampling(_sampling(values, info, default_max_tokens, names, fill=True), info, logprobs, top)
    tools = plan_tools(body, info.tool_call_format)
    sp.constraint = constraint_of(body)
    if tools is not None and tools.mode != "auto" and sp.constraint is not None:
        raise invalid(f"tool_choice {body['tool_choice']!r} constrains the output already: drop the other "
                      "output constraint", param="tool_choice")
    if tools is not None and sp.constraint is None:
        sp.constraint = tools.constraint()
    messages = [_chat_message(m) for m in body["messages"]]
    prompt_logprobs = body.get("prompt_logprobs")
    _ask_prompt_logprobs(sp, stream, False, prompt_logprobs, None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    prompt = {"messages": messages, "tools": tools.tools if tools is not None else None,
              "tool_call_format": tools.format.name if tools is not None else ""}
    calls = _with_adapter(_calls(rid, sp, n, [prompt], body, default_max_tokens, fills), adapter)
    return ParsedRequest("chat", rid, model, calls, n, stream, include_usage, logprobs, top, tools,
                         prompt_logprobs=-1 if prompt_logprobs is None else prompt_logprobs)


def _chat_message(m: dict) -> dict:
    """A schema-checked message → the tokenizer's (content joined; null content, as an assistant
    message with tool_calls may have, is empty)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content)
    msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        if m.get(key) is not None:
            msg[key] = m[key]
    return msg


def parse_generate(body: dict, info: ModelInfo, served: Sequence[str], default_max_tokens: int | None = None
                   ) -> ParsedRequest:
    if ("text" in body) == ("input_ids" in body):
        raise invalid("give exactly one of text and input_ids", param="text")
    body = _validated(schemas.GENERATE_REQUEST, body)
    if sglang_compat.is_batch(body):  # SGLang's batch: one call per prompt, answered as a list
        return sglang_compat.parse_batch(body, parse_generate, info, served, default_max_tokens)
    body = sglang_compat.without_frontend_extras(body)
    params = body.get("sampling_params") or {}
    values = {**params, "max_tokens": params.get("max_new_tokens"), "min_tokens": params.get("min_new_tokens")}
    names = {"max_tokens": "sampling_params.max_new_tokens", "min_tokens": "sampling_params.min_new_tokens",
             "stop_token_ids": "sampling_params.stop_token_ids"}
    sp = _sampling(values, info, default_max_tokens, names)
    logprobs, top = bool(body.get("return_logprob")), body.get("top_logprobs_num") or 0
    sp = _finish_sampling(sp, info, logprobs or top > 0, top)
    start = body.get("logprob_start_len")
    input_logprobs = logprobs and start is not None and start >= 0  # SGLang's input logprobs
    if input_logprobs:
        sp.prompt_logprobs, sp.logprob_start_len = top, start
    sp.constraint = constraint_of(params, json_schema_field=True)
    if "input_ids" in body:
        _check_ids(body["input_ids"], info, "input_ids")
        prompt = {"input_ids": body["input_ids"]}
    else:
        prompt = {"text": body["text"]}
    rid = body.get("rid") or uuid.uuid4().hex
    n = params.get("n") or 1
    adapter = body.get("adapter") or body.get("lora_path") or ""  # SGLang names it lora_path
    if adapter and adapter not in info.adapters:
        raise invalid(f"unknown LoRA adapter {adapter!r} (loaded: {', '.join(info.adapters) or 'none'})",
                      param="adapter")
    calls = _with_adapter(_calls(rid, sp, n, [prompt], params), adapter)
    return ParsedRequest("generate", rid, adapter or served[0], calls, n, bool(body.get("stream")), False,
                         sp.logprobs, top, input_logprobs=input_logprobs)
