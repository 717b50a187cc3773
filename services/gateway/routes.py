"""HTTP handlers: parse → backend.generate per prompt → shape, as JSON or SSE.

Every generation route runs `_serve`: the first backend event is awaited
before anything is sent, so a request the mesh refuses (bad input, queue
full) gets its HTTP status even when it asked to stream; a failure after
that becomes an SSE error event before `data: [DONE]`. Leaving `_serve` by
any path (done, error, client gone: the handler is cancelled, or a write
fails) closes the event iterator, which cancels the gRPC calls and so aborts
the request in the mesh. A stream cancelled by the gateway's drain deadline
ends cleanly: each unfinished choice gets a `finish_reason: "abort"` chunk,
then `data: [DONE]` (a request not streaming yet gets 503: app.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.common.logging import request_context
from services.gateway import observe, shaping
from services.gateway.auth import KEYS
from services.gateway.backend import Backend, BackendError, Event, GenerateCall
from services.gateway.errors import APIError, from_backend
from services.gateway.limits import TOKENS_USED, check_caps
from services.gateway.openai_protocol import (ParsedRequest, decode_json, model_not_found_message, parse_chat,
                                              parse_completion, parse_generate)
from services.gateway.openapi import document
from services.gateway.sse import EventStream
from services.gateway.state import STATE, GatewayState

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


async def merged(backend: Backend, calls: list[GenerateCall]) -> AsyncIterator[tuple[int, list[Event]]]:
    """(call index, the events of one backend message) from all calls, as they come. Closing
    this iterator closes every call's iterator (cancelling its RPC)."""
    if len(calls) == 1:
        async with contextlib.aclosing(backend.generate(calls[0])) as batches:
            async for batch in batches:
                yield 0, batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, call: GenerateCall) -> None:
        try:
            async with contextlib.aclosing(backend.generate(call)) as batches:
                async for batch in batches:
                    queue.put_nowait((i, batch))
            queue.put_nowait((i, None))
        except BackendError as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(calls)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BackendError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve(request: web.Request, parse: Callable[..., ParsedRequest]) -> web.StreamResponse:
    state: GatewayState = request.app[STATE]
    config = state.config
    info = await state.require_info()
    body = decode_json(await request.read())
    req = parse(body, info, state.served_names, config.max_tokens_default(parse is parse_generate))
    check_caps(req, body, config.max_n, config.max_stop, config.max_tokens_limit)
    with request_context(req.id):
        t0 = time.monotonic()
        async with contextlib.aclosing(merged(state.backend, req.calls)) as events:
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise BackendError("INTERNAL", "the backend ended the request without a result") from None
            except BackendError as e:
                log.info("refused", extra={"code": e.code, "error": e.message})
                raise
            metrics = request.app[observe.METRICS]
            observe.generation_started(req, state.served_name, t0, metrics)
            col = shaping.Collector(req)
            try:
                if req.stream:
                    response = await _stream(request, req, col, first, events, state)
                else:
                    response = await _whole(req, col, first, events)
            finally:  # finished, failed or cut off: what the mesh computed counts (--rate-limit-tpm)
                request[TOKENS_USED] = col.usage()["total_tokens"]
            if col.done:
                observe.generation_done(col, state.served_name, metrics)
        log.info("done", extra={"route": req.kind, "stream": req.stream, "seconds": round(time.monotonic() - t0, 4),
                                **col.usage()})
        return response


async def _whole(req: ParsedRequest, col: shaping.Collector, first: tuple[int, list[Event]],
                 events: AsyncIterator[tuple[int, list[Event]]]) -> web.Response:
    for i, batch in (first,):
        for event in batch:
            col.add(i, event)
    async for i, batch in events:
        for event in batch:
            col.add(i, event)
    if not col.done:
        raise BackendError("INTERNAL", "the backend ended the request before every sequence finished")
    shape = {"completion": shaping.completion_response, "chat": shaping.chat_response,
             "generate": shaping.generate_response}[req.kind]
    return web.json_response(shape(col), dumps=_dumps)


async def _stream(request: web.Request, req: ParsedRequest, col: shaping.Collector, first: tuple[int, list[Event]],
                  events: AsyncIterator[tuple[int, list[Event]]], state: GatewayState) -> web.StreamResponse:
    stream = EventStream(request)
    started: set[int] = set()

    async def send(i: int, batch: list[Event]) -> None:
        """One backend message's events: their SSE frames in one write."""
        objs = []
        for event in batch:
            index = col.add(i, event)
            obj = shaping.stream_chunk(col, index, event, first=index not in started)
            started.add(index)
            if obj is not None:
                objs.append(obj)
        if objs:
            await stream.send(*objs)

    try:
        await _relay(send, first, events, col, state)
        if not col.done:
            raise BackendError("INTERNAL", "the backend ended the request before every sequence finished")
        if req.include_usage:
            await stream.send(shaping.usage_chunk(col))
    except BackendError as e:  # mid-stream: the status line is gone, so an error event
        log.warning("failed mid-stream", extra={"code": e.code, "error": e.message})
        try:
            await stream.send(from_backend(e, state.config.retry_after_s).body())
        except ConnectionResetError:
            return _gone(stream)
    except ConnectionResetError:  # the client went away; leaving aborts the backend calls
        return _gone(stream)
    try:
        return await stream.done()
    except ConnectionResetError:
        return _gone(stream)


async def _relay(send: Callable[[int, list[Event]], Awaitable[None]], first: tuple[int, list[Event]],
                 events: AsyncIterator[tuple[int, list[Event]]], col: shaping.Collector, state: GatewayState) -> None:
    """Send every event; cancelled by the drain deadline, finish each unfinished choice with an abort."""
    try:
        await send(*first)
        async for i, batch in events:
            await send(i, batch)
    except asyncio.CancelledError:
        if not state.cancelled_by_drain():
            raise
        log.info("stream cut off by the drain deadline")
        for i, event in col.aborts():
            await send(i, [event])


def _gone(stream: EventStream) -> web.StreamResponse:
    log.info("client disconnected mid-stream")
    return stream.response


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat)


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_generate)


def _model_card(state: GatewayState) -> dict:
    info = state.info
    return {"id": state.served_name, "object": "model", "created": state.started, "owned_by": "radixmesh",
            "root": state.served_name, "parent": None, "max_model_len": info.context_length,
            "weights_version": info.weights_version or "0"}


def _adapter_cards(state: GatewayState) -> list[dict]:
    """The loaded LoRA adapters, as vLLM lists them: parent is the base model."""
    info = state.info
    return [{"id": name, "object": "model", "created": state.started, "owned_by": "radixmesh", "root": path,
             "parent": state.served_name, "max_model_len": info.context_length,
             "weights_version": info.weights_version or "0"}
            for name, path in zip(info.adapters, info.adapter_paths)]


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    await state.require_info()
    return web.json_response({"object": "list", "data": [_model_card(state), *_adapter_cards(state)]})


@routes.get("/v1/models/{model:.+}")  # model names may contain "/"
async def get_model(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    await state.require_info()
    name = request.match_info["model"]
    if name in state.served_names:
        return web.json_response(_model_card(state))
    card = next((c for c in _adapter_cards(state) if c["id"] == name), None)
    if card is None:
        raise APIError(404, model_not_found_message(name, [*state.served_names, *state.info.adapters]),
                       "invalid_request_error", param="model", code="model_not_found")
    return web.json_response(card)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    if not state.ready:
        raise APIError(503, state.not_ready_reason, "service_unavailable_error", code="not_ready",
                       retry_after=state.config.retry_after_s)
    return web.json_response({"status": "ready", "model": state.served_name})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    keys = request.app[KEYS]
    return web.json_response(document(state.served_names or None, api_keys=keys.user_keys,
                                      open_probes=not keys.probes_need_key))
