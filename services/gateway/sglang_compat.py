"""What SGLang's frontend language (sglang.lang, its RuntimeEndpoint backend) asks of a server,
beyond /generate's single-prompt shape: GET /get_model_info, POST /flush_cache, and /generate
bodies that carry a batch (`text` a list of strings, `input_ids` a list of lists: the answer is
a list, one object per prompt × n) or the frontend's extra fields.

The batch is split here into single /generate bodies, each parsed as usual (parse_generate is
passed in, so this module imports no parser), and merged into one request of several calls."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from protos.radixmesh.v1 import scheduler_pb2 as spb
from services.gateway.backend import BackendError
from services.gateway.errors import APIError, from_backend
from services.gateway.model_admin import refuse_parameters
from services.gateway.state import STATE, GatewayState

sglang_routes = web.RouteTableDef()

MAX_BATCH = 64  # prompts in one /generate body, as /v1/completions allows

# Fields SGLang's frontend sends that change nothing here: radixmesh always puts a token's text in
# its logprob entries, and its detokenizer joins special tokens as the tokenizer spells them.
_ACCEPTED = ("return_text_in_logprobs",)
_ACCEPTED_SAMPLING = ("spaces_between_special_tokens", "stop_regex")


def is_batch(body: dict) -> bool:
    ids = body.get("input_ids")
    return isinstance(body.get("text"), list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))


def without_frontend_extras(body: dict) -> dict:
    """`body` less the fields SGLang's frontend adds that need nothing done; a stop_regex that is set
    is refused (radixmesh has string and token stops, not regular-expression ones)."""
    params = body.get("sampling_params")
    if isinstance(params, dict) and params.get("stop_regex"):
        raise APIError(400, "sampling_params.stop_regex is not supported: use stop (strings) or regex (constrains "
                       "the whole output)", "invalid_request_error", param="sampling_params.stop_regex")
    out = {k: v for k, v in body.items() if k not in _ACCEPTED}
    if isinstance(params, dict):
        out["sampling_params"] = {k: v for k, v in params.items() if k not in _ACCEPTED_SAMPLING}
    return out


def parse_batch(body: dict, parse_one: Callable[..., Any], *args: Any) -> Any:
    """A batched /generate body → one ParsedRequest whose calls are the prompts' (each parsed by
    `parse_one` as a single body), answered as a list (extra["batch"])."""
    key = "text" if isinstance(body.get("text"), list) else "input_ids"
    items = body[key]
    if not items or len(items) > MAX_BATCH:
        raise APIError(400, f"{key} as a batch holds 1 to {MAX_BATCH} prompts, got {len(items)}",
                       "invalid_request_error", param=key)
    if body.get("stream"):
        raise APIError(400, "a batch of prompts cannot stream: send one prompt per request", "invalid_request_error",
                       param="stream")
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [f"{rid or uuid.uuid4().hex}-{i}" for i in range(len(items))]
    if len(rids) != len(items):
        raise APIError(400, f"rid as a list needs one id per prompt ({len(items)})", "invalid_request_error",
                       param="rid")
    parsed = [parse_one({**body, key: item, "rid": r}, *args) for item, r in zip(items, rids)]
    first = parsed[0]
    calls = [c for p in parsed for c in p.calls]
    return replace(first, calls=calls, input_logprobs=any(p.input_logprobs for p in parsed),
                   extra={**first.extra, "batch": True})


def model_info(state: GatewayState) -> dict:
    """SGLang's /get_model_info: the model's path is the served name (what the mesh was started with)."""
    return {"model_path": state.served_name, "tokenizer_path": state.served_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": state.info.weights_version or "0",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": None,
            "architectures": None, "max_model_len": state.info.context_length,
            "vocab_size": state.info.vocab_size}


@sglang_routes.get("/get_model_info")
async def get_model_info(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    await state.require_info()
    return web.json_response(model_info(state))


@sglang_routes.post("/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    """Drops every cached prefix (an admin route: auth.py) through the backend's ModelAdmin.FlushCache:
    the router fans it out to every replica, each tokenizer forwards it to its scheduler. 400 while a
    scheduler has requests running or waiting (it flushes nothing then), as SGLang's flush refuses."""
    await refuse_parameters(request)
    state: GatewayState = request.app[STATE]
    admin = getattr(state.backend, "admin", None)
    if admin is None:
        raise APIError(400, "this gateway's backend cannot flush the prefix cache (it has no model administration)",
                       "invalid_request_error", code="unsupported")
    try:
        await admin("FlushCache", spb.FlushCacheRequest())
    except BackendError as e:
        raise from_backend(e, state.config.retry_after_s) from None
    return web.Response(text="Cache flushed.\n")


def openapi_paths() -> dict:
    """The routes above for /openapi.json."""
    obj = {"type": "object"}
    return {
        "/get_model_info": {"get": {"summary": "The served model in SGLang's shape (model_path, is_generation, ...)",
                                    "responses": {"200": {"description": "The model.", "content": {
                                        "application/json": {"schema": {
                                            "type": "object", "required": ["model_path", "is_generation"],
                                            "properties": {"model_path": {"type": "string"},
                                                           "is_generation": {"type": "boolean"}}}}}}}}},
        "/flush_cache": {"post": {"summary": "Drop every cached prefix (SGLang's; an admin route)",
                                  "requestBody": {"required": False, "content": {"application/json": {"schema": {
                                      "type": "object", "maxProperties": 0, "description": "no body, or {}"}}}},
                                  "responses": {"200": {"description": "Flushed."},
                                                "403": {"description": "A user key on an admin route, or admin "
                                                                       "routes are off (no --admin-api-key).",
                                                        "content": {"application/json": {"schema": obj}}},
                                                "400": {"description": "Requests are running or waiting (nothing "
                                                                       "flushed), or the backend cannot flush.",
                                                        "content": {"application/json": {"schema": obj}}}}}},
    }
