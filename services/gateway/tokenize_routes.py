"""Tokenize and detokenize over HTTP, in vLLM's paths and shapes and in SGLang's.

vLLM:   POST /tokenize    {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                           return_token_strs?, tools?} → {count, max_model_len, tokens, token_strs}
        POST /detokenize  {model?, tokens} → {prompt}
SGLang: POST /v1/tokenize   {model?, prompt: str | [str], add_special_tokens?}
                             → {tokens, count, max_model_len} (lists of them for a list of prompts)
        POST /v1/detokenize {model?, tokens: [int] | [[int]], skip_special_tokens?} → {text: str | [str]}

Messages are rendered by the model's chat template in the tokenizer service (ApplyChatTemplate),
then tokenized without special tokens unless add_special_tokens says otherwise (the template
wrote them), as vLLM does. The request schemas are here; openapi.py publishes them.
"""
from __future__ import annotations

from aiohttp import web

from services.gateway import schemas
from services.gateway.errors import invalid
from services.gateway.openai_protocol import _chat_message, _check_model, decode_json
from services.gateway.state import STATE, GatewayState

tokenize_routes = web.RouteTableDef()

_MODEL = {"type": ["string", "null"], "description": "a served model name (optional)"}
_IDS = {**schemas.TOKEN_IDS, "minItems": 0, "maxItems": 1 << 20}
VLLM_TOKENIZE = {
    "type": "object", "additionalProperties": False, "properties": {
        "model": _MODEL, "prompt": {"type": "string"},
        "messages": {"type": "array", "items": schemas.CHAT_MESSAGE, "minItems": 1, "maxItems": 1024},
        "tools": {"type": ["array", "null"], "items": schemas.TOOL, "maxItems": 128},
        "add_special_tokens": {**schemas.BOOL, "description": "default: true for prompt, false for messages"},
        "add_generation_prompt": {**schemas.BOOL, "description": "messages only; default true"},
        "return_token_strs": schemas.BOOL},
    "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    "description": "exactly one of prompt and messages"}
VLLM_DETOKENIZE = {"type": "object", "additionalProperties": False, "required": ["tokens"],
                   "properties": {"model": _MODEL, "tokens": _IDS}}
SGLANG_TOKENIZE = {
    "type": "object", "additionalProperties": False, "required": ["prompt"], "properties": {
        "model": _MODEL, "add_special_tokens": schemas.BOOL,
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 1024}]}}}
SGLANG_DETOKENIZE = {
    "type": "object", "additionalProperties": False, "required": ["tokens"], "properties": {
        "model": _MODEL, "skip_special_tokens": schemas.BOOL,
        "tokens": {"anyOf": [_IDS, {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 1024}]}}}


async def _body(request: web.Request, schema: dict) -> tuple[GatewayState, dict]:
    state: GatewayState = request.app[STATE]
    info = await state.require_info()
    body = decode_json(await request.read())
    try:
        body = schemas.check(schema, body)
    except schemas.SchemaError as e:
        if e.param == "" and "exactly one" in e.message:
            raise invalid("give exactly one of prompt and messages", param="prompt") from None
        raise invalid(e.message, param=e.param or None) from None
    if body.get("model") is not None:
        _check_model(body, state.served_names, info)
    return state, body


def _flag(body: dict, key: str, default: bool) -> bool:
    return default if body.get(key) is None else body[key]


@tokenize_routes.post("/tokenize")
async def vllm_tokenize(request: web.Request) -> web.Response:
    state, body = await _body(request, VLLM_TOKENIZE)
    backend = state.backend
    if "messages" in body:
        if not state.info.has_chat_template:
            raise invalid("the model has no chat template: tokenize a prompt", param="messages")
        text = await backend.apply_chat_template([_chat_message(m) for m in body["messages"]], body.get("tools"),
                                                 _flag(body, "add_generation_prompt", True))
        add = _flag(body, "add_special_tokens", False)
    else:
        if body.get("add_generation_prompt") is not None or body.get("tools") is not None:
            raise invalid("add_generation_prompt and tools need messages",
                          param="add_generation_prompt" if body.get("add_generation_prompt") is not None else "tools")
        text, add = body["prompt"], _flag(body, "add_special_tokens", True)
    (ids,) = await backend.tokenize([text], add)
    strs = None
    if body.get("return_token_strs"):
        _, (strs,) = await backend.detokenize([ids], False)
    return web.json_response({"count": len(ids), "max_model_len": state.info.context_length, "tokens": ids,
                              "token_strs": strs})


@tokenize_routes.post("/detokenize")
async def vllm_detokenize(request: web.Request) -> web.Response:
    state, body = await _body(request, VLLM_DETOKENIZE)
    (text,), _ = await state.backend.detokenize([body["tokens"]], True)
    return web.json_response({"prompt": text})


@tokenize_routes.post("/v1/tokenize")
async def sglang_tokenize(request: web.Request) -> web.Response:
    state, body = await _body(request, SGLANG_TOKENIZE)
    prompt = body["prompt"]
    texts = [prompt] if isinstance(prompt, str) else prompt
    ids = await state.backend.tokenize(texts, _flag(body, "add_special_tokens", True)) if texts else []
    n = state.info.context_length
    if isinstance(prompt, str):
        return web.json_response({"tokens": ids[0], "count": len(ids[0]), "max_model_len": n})
    return web.json_response({"tokens": ids, "count": [len(i) for i in ids], "max_model_len": n})


@tokenize_routes.post("/v1/detokenize")
async def sglang_detokenize(request: web.Request) -> web.Response:
    state, body = await _body(request, SGLANG_DETOKENIZE)
    tokens = body["tokens"]
    one = not tokens or isinstance(tokens[0], int)
    texts, _ = await state.backend.detokenize([tokens] if one else tokens, _flag(body, "skip_special_tokens", True))
    return web.json_response({"text": texts[0] if one else texts})
