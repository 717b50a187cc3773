"""The /openapi.json document (OpenAPI 3.1): request schemas come from
schemas.py, the very dicts the gateway validates with; response schemas here.
With API keys (auth.py) it declares the bearer scheme as every operation's
requirement, but for the probes while they are open, and the 401 answer."""
from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

from services.gateway import schemas
from services.gateway import embeddings as emb
from services.gateway import sglang_compat
from services.gateway import tokenize_routes as tr
from services.gateway.responses_protocol import RESPONSES_REQUEST

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_COUNT = {"type": "integer", "minimum": 0}
_RATE = {"type": "number", "minimum": 0, "maximum": 1}
_SPECULATIVE = {
    "type": "object", "required": ["verify_steps", "draft_tokens", "accepted_tokens", "acceptance_rate"],
    "description": "radixmesh's extra, present only when the request speculated: verify steps run, tokens "
                   "drafted, drafted tokens accepted (summed over the n sequences), accepted / drafted",
    "properties": {"verify_steps": _COUNT, "draft_tokens": _COUNT, "accepted_tokens": _COUNT,
                   "acceptance_rate": _RATE},
}
_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                  "properties": {"cached_tokens": {"type": "integer"}}},
        "speculative": _SPECULATIVE,
    },
}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", None]}
_MATCHED = {"type": ["string", "integer", "null"]}


def _response(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "finish_reason", *choice],
                               "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                                              "matched_stop": _MATCHED, "logprobs": {"type": ["object", "null"]},
                                              **choice}}}}}


_COMPLETION = _response("text_completion", {"text": {"type": "string"}})
_CHAT = _response("chat.completion", {"message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}})
_GENERATE_ONE = {
    "type": "object", "required": ["text", "output_ids", "meta_info"],
    "properties": {"text": {"type": "string"}, "output_ids": {"type": "array", "items": {"type": "integer"}},
                   "meta_info": {"type": "object", "required": ["id", "finish_reason", "prompt_tokens",
                                                                "completion_tokens", "cached_tokens"],
                                 "properties": {  # the spec_* keys only when the request speculated
                                     "spec_verify_ct": _COUNT, "spec_draft_tokens": _COUNT,
                                     "spec_accepted_tokens": _COUNT, "spec_acceptance_rate": _RATE}}},
}
_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                         "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}


# One server-sent event (before 3.2, an event stream's schema describes each event).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk, an error envelope {\"error\": ...}, or [DONE] last"},
    "event": {"type": "string"}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
_ERRORS = {
    "400": _json(_ERROR, "invalid input: malformed JSON, a bad or unknown parameter, an unknown model, "
                         "a prompt beyond the context length, a value above this server's caps"),
    "408": _json(_ERROR, "the body did not arrive within --body-timeout-s"),
    "413": _json(_ERROR, "the body is larger than --max-request-bytes"),
    "503": {**_json(_ERROR, "the queue is full or the backend is unavailable; retry later"), "headers": _RETRY},
}
_LIMITED = {"429": {**_json(_ERROR, "a rate limit (--rate-limit-rpm, --rate-limit-tpm) was reached; retry "
                                    "after Retry-After seconds"), "headers": _RETRY}}
_UNAUTHORIZED = {"401": _json(_ERROR, "no valid API key: send `Authorization: Bearer KEY`")}
_SCHEME = "apiKey"
_PROBES = ("/health", "/ready")


# The expert distribution recorder (model_admin.py): ExpertDump's JSON, what --init-expert-location reads.
_COUNTS = {"type": "array", "items": _COUNT}
_DUMP_FIELDS = {"layers": {**_COUNTS, "description": "the decoder layers with experts, in row order"},
                "logical_count": {"type": "array", "items": _COUNTS,
                                  "description": "tokens routed to each logical expert: [layers][experts]"},
                "forwards": _COUNT, "seconds": {"type": "number", "minimum": 0}, "recording": {"type": "boolean"}}
_DUMP_REQUIRED = ["layers", "logical_count", "forwards", "seconds", "recording"]
_EXPERT_DUMP = {"type": "object", "required": _DUMP_REQUIRED, "properties": {
    **_DUMP_FIELDS,
    "replicas": {"type": "array", "description": "behind a router: each replica's recording (the top level "
                                                 "adds them up)",
                 "items": {"type": "object", "required": ["address", *_DUMP_REQUIRED],
                           "properties": {"address": {"type": "string"}, **_DUMP_FIELDS}}}}}
_ADMIN_ERRORS = {
    "400": _json(_ERROR, "the model has no experts, or nothing was recorded yet (dump before any start)"),
    "401": _json(_ERROR, "no valid admin key: send `Authorization: Bearer ADMIN_KEY`"),
    "403": _json(_ERROR, "a user key on an admin route, or admin routes are off (no --admin-api-key)"),
    "404": _json(_ERROR, "the backend has no model administration"),
    "503": _ERRORS["503"],
}
_EXPERT_ACTIONS = {
    "start": "Start recording how many tokens the MoE router sends to each expert (a running recording "
             "restarts from zero); answers the new recording",
    "stop": "Stop the recording; answers it (dumps keep returning it)",
    "dump": "The running recording, else the last stopped one: save it as an --init-expert-location file",
}


_NO_PARAMETERS = {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "maxProperties": 0, "description": "no parameters: no body, or {}"}}}}


def _expert_distribution(action: str, method: str) -> dict:
    op = {"summary": _EXPERT_ACTIONS[action] + ". Needs the admin key.",
          "responses": {"200": _json(_EXPERT_DUMP, "The recording (ExpertDump's JSON)."), **_ADMIN_ERRORS,
                        **_LIMITED}}
    return {method: {**op, "requestBody": _NO_PARAMETERS} if method == "post" else op}


def _expert_paths() -> dict:
    """/admin/expert_distribution/{start,stop,dump} and SGLang's /{action}_expert_distribution_record."""
    paths = {f"/{a}_expert_distribution_record": _expert_distribution(a, "post") for a in _EXPERT_ACTIONS}
    for action in _EXPERT_ACTIONS:
        paths[f"/admin/expert_distribution/{action}"] = _expert_distribution(action,
                                                                            "get" if action == "dump" else "post")
    return paths


def _generation(summary: str, request: dict, ok: dict, ok_description: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": ok_description + " With stream=true: text/event-stream of `data: <json>` "
                                                    "events, an error event on a failure mid-stream, then "
                                                    "`data: [DONE]`.",
                    "content": {"application/json": {"schema": ok},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            **_ERRORS,
            **_LIMITED,
        },
    }}


_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
             "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                            "created_at": {"type": "integer"}, "model": {"type": "string"},
                            "status": {"enum": ["in_progress", "completed", "incomplete", "cancelled", "failed"]},
                            "output": {"type": "array", "items": {"type": "object", "required": ["id", "type"]}}}}
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
_NO_RESPONSE = _json(_ERROR, "No stored response has this id (store=false, expired, evicted or never existed).")


def _responses_paths(model_names: tuple[str, ...]) -> dict:
    """The Responses API (services/gateway/responses.py)."""
    create = _generation("Create a model response (OpenAI's Responses API), served as a chat completion; "
                         "streamed as OpenAI's response.* events", _with_model(RESPONSES_REQUEST, model_names),
                         _RESPONSE, "The response.")
    return {"/v1/responses": create,
            "/v1/responses/{response_id}": {"get": {
                "summary": "A stored response", "parameters": _RESPONSE_ID,
                "responses": {"200": _json(_RESPONSE, "The response."), "404": _NO_RESPONSE, **_LIMITED}}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a stored response in progress", "parameters": _RESPONSE_ID,
                "requestBody": _NO_PARAMETERS,
                "responses": {"200": _json(_RESPONSE, "The response, cancelled."),
                              "400": _json(_ERROR, "The response has ended (not cancelled)."),
                              "404": _NO_RESPONSE, **_LIMITED}}}}


def _post(summary: str, request: dict, ok: dict) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                     "responses": {"200": _json(ok, "The result."), **_ERRORS, **_LIMITED}}}


def _tokenize_paths() -> dict:
    """vLLM's /tokenize and /detokenize, SGLang's /v1/tokenize and /v1/detokenize (tokenize_routes.py)."""
    ids, n = {"type": "array", "items": {"type": "integer"}}, {"type": "integer"}
    many = {"type": "array", "items": ids}
    return {
        "/tokenize": _post("Token ids of a prompt, or of messages rendered by the chat template (vLLM)",
                           tr.VLLM_TOKENIZE, {"type": "object", "required": ["count", "max_model_len", "tokens"],
                                              "properties": {"count": n, "max_model_len": n, "tokens": ids,
                                                             "token_strs": {"type": ["array", "null"]}}}),
        "/detokenize": _post("Text of token ids (vLLM)", tr.VLLM_DETOKENIZE,
                             {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
        "/v1/tokenize": _post("Token ids of a prompt or of several (SGLang)", tr.SGLANG_TOKENIZE, {
            "type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
                "tokens": {"anyOf": [ids, many]}, "count": {"anyOf": [n, {"type": "array", "items": n}]},
                "max_model_len": n}}),
        "/v1/detokenize": _post("Text of token ids, or of several lists of them (SGLang)", tr.SGLANG_DETOKENIZE, {
            "type": "object", "required": ["text"], "properties": {"text": {"anyOf": [
                {"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}}),
    }


def _with_model(request: dict, model_names: tuple[str, ...]) -> dict:
    """The served names are the only valid `model`s: say so (fuzzers then use them)."""
    if not model_names:
        return request
    out = copy.deepcopy(request)
    out["properties"]["model"] = {**out["properties"]["model"], "enum": list(model_names)}
    return out


def _with_auth(doc: dict, open_probes: bool) -> dict:
    """`doc` with the bearer scheme required (the probes exempt while open) and 401 answered."""
    doc["components"] = {"securitySchemes": {_SCHEME: {
        "type": "http", "scheme": "bearer", "description": "an API key of the gateway (--api-key)"}}}
    doc["security"] = [{_SCHEME: []}]
    for path, item in doc["paths"].items():
        for op in item.values():
            if open_probes and path in _PROBES:
                op["security"] = []
            else:
                op["responses"].update(_UNAUTHORIZED)
    return doc


@functools.cache
def _document(model_names: tuple[str, ...], api_keys: bool, open_probes: bool) -> dict:
    doc = _plain(model_names)
    if not open_probes:  # then rate-limited like every other route
        for path in _PROBES:
            doc["paths"][path]["get"]["responses"].update(_LIMITED)
    return _with_auth(doc, open_probes) if api_keys else doc


def _plain(model_names: tuple[str, ...]) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixmesh gateway", "version": "1",
                 "description": "OpenAI-compatible HTTP API of a radixmesh replica, plus a native /generate. "
                                "Errors use OpenAI's envelope {\"error\": {message, type, param, code}}."},
        "paths": {
            "/v1/completions": _generation("Text completion (OpenAI)",
                                           _with_model(schemas.COMPLETION_REQUEST, model_names), _COMPLETION,
                                           "The completion."),
            "/v1/chat/completions": _generation("Chat completion (OpenAI); the model's chat template renders "
                                                "the messages", _with_model(schemas.CHAT_REQUEST, model_names),
                                                _CHAT, "The completion."),
            "/generate": _generation("Native generation from text or token ids (SGLang-like)",
                                     schemas.GENERATE_REQUEST,
                                     {"anyOf": [_GENERATE_ONE, {"type": "array", "items": _GENERATE_ONE}]},
                                     "One object, or a list when n > 1. Streamed events carry the text and "
                                     "ids so far."),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": _json({"type": "object", "required": ["object", "data"],
                              "properties": {"object": {"const": "list"},
                                             "data": {"type": "array", "items": _MODEL}}}, "The model list."),
                "503": _ERRORS["503"], **_LIMITED}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json(_MODEL, "The model."),
                              "404": _json(_ERROR, "No such model."), "503": _ERRORS["503"], **_LIMITED}}},
            "/health": {"get": {"summary": "Liveness: 200 while the process runs", "responses": {
                "200": _json({"type": "object", "properties": {"status": {"const": "ok"}}}, "Alive.")}}},
            "/ready": {"get": {"summary": "Readiness: 200 when the backend is SERVING and answers Info",
                               "responses": {"200": _json({"type": "object", "required": ["status"],
                                                           "properties": {"status": {"const": "ready"},
                                                                          "model": {"type": "string"}}},
                                                          "Ready."),
                                             "503": _ERRORS["503"]}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": _json({"type": "object"}, "The OpenAPI document."), **_LIMITED}}},
            **_expert_paths(),
            **_responses_paths(model_names),
            **_tokenize_paths(),
            **sglang_compat.openapi_paths(),
            "/v1/embeddings": _post("Embeddings of texts or token ids: the served model's final hidden states, "
                                    "pooled (--pooling) and L2-normalized (OpenAI)",
                                    _with_model(emb.EMBEDDING_REQUEST, model_names), emb.EMBEDDING_RESPONSE),
        },
    }


def document(model_names: str | Sequence[str] | None = None, api_keys: bool = False,
             open_probes: bool = True) -> dict:
    """A fresh copy of the document (callers may mutate it); with the served
    names (one name or several) when they are known; with `api_keys` the bearer
    scheme (the gateway has user keys), /health and /ready exempt when `open_probes`."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names or ())
    return copy.deepcopy(_document(names, api_keys, open_probes))
