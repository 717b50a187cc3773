"""POST /v1/embeddings (OpenAI): the served model's pooled final hidden states.

Each input (a string, a list of them, a list of token ids, or a list of such lists) runs as a
prefill-only request (max_new_tokens 0, SamplingParams.embed) through the same backend as
generation: the worker pools the final norm's output over the prompt (--pooling last | mean) and
L2-normalizes it; nothing is sampled, and the prompt's KV is cached like any finished request's.
encoding_format "base64" (the openai SDK's default) is the float32 little-endian bytes, base64.
The model's hidden size is the only dimension: any `dimensions` is a 400 naming it.
"""
from __future__ import annotations

import base64
import contextlib
import struct
import uuid

from aiohttp import web

from services.common.sampling_params import SamplingParams
from services.gateway import schemas
from services.gateway.backend import BackendError, GenerateCall
from services.gateway.errors import invalid
from services.gateway.limits import TOKENS_USED
from services.gateway.openai_protocol import MAX_SEQUENCES, _check_ids, _check_model, decode_json
from services.gateway.state import STATE, GatewayState

embeddings_routes = web.RouteTableDef()

_TEXTS = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_SEQUENCES}
_IDS = {**schemas.TOKEN_IDS, "minItems": 1}
EMBEDDING_REQUEST = {
    "type": "object", "additionalProperties": False, "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "description": "the served model's name (GET /v1/models)"},
        "input": {"anyOf": [{"type": "string", "minLength": 1}, _TEXTS, _IDS,
                            {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_SEQUENCES}],
                  "description": "a string, strings, token ids, or lists of token ids"},
        "encoding_format": {"enum": ["float", "base64", None], "description": "default float"},
        "dimensions": {**schemas._int(1, schemas.INT32_MAX), "description": "not supported: the embedding has "
                                                                            "the model's hidden size"},
        "user": {"type": ["string", "null"]},
    },
}
EMBEDDING_RESPONSE = {
    "type": "object", "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"}, "model": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {"object": {"const": "embedding"},
                                                           "index": {"type": "integer"},
                                                           "embedding": {"anyOf": [{"type": "array",
                                                                                    "items": {"type": "number"}},
                                                                                   {"type": "string"}]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
    },
}


def _prompts(value) -> list[dict]:
    if isinstance(value, str):
        return [{"text": value}]
    if isinstance(value[0], str):
        return [{"text": v} for v in value]
    if isinstance(value[0], int):
        return [{"input_ids": value}]
    return [{"input_ids": v} for v in value]


@embeddings_routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    info = await state.require_info()
    body = decode_json(await request.read())
    try:
        body = schemas.check(EMBEDDING_REQUEST, body)
    except schemas.SchemaError as e:
        raise invalid(e.message, param=e.param or None) from None
    model, adapter = _check_model(body, state.served_names, info)
    if body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: the embedding has the model's hidden size", param="dimensions")
    prompts = _prompts(body["input"])
    for p in prompts:
        if "input_ids" in p:
            _check_ids(p["input_ids"], info, "input")
    rid = f"embd-{uuid.uuid4().hex}"
    calls = [GenerateCall(f"{rid}-{i}", SamplingParams(max_new_tokens=0, temperature=0.0, embed=True), adapter=adapter,
                          **p) for i, p in enumerate(prompts)]
    from services.gateway.routes import merged  # routes -> openapi -> this module: imported when used
    vectors: list[list[float]] = [[] for _ in calls]
    tokens = [0] * len(calls)
    async with contextlib.aclosing(merged(state.backend, calls)) as events:
        async for i, batch in events:
            for event in batch:
                vectors[i] += event.embedding
                tokens[i] = max(tokens[i], event.prompt_tokens)
    if any(not v for v in vectors):
        raise BackendError("INTERNAL", "the backend returned no embedding")
    request[TOKENS_USED] = sum(tokens)
    base64_out = body.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if base64_out else v}
            for i, v in enumerate(vectors)]
    return web.json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}})
