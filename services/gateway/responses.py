"""HTTP handlers of the Responses API: POST /v1/responses, GET /v1/responses/{id}, POST
/v1/responses/{id}/cancel.

A request is converted to a chat completion (responses_protocol.py) and runs as one backend
call, as chat does in routes.py: the first event is awaited before anything is sent, so a
refused request gets its HTTP status even when streaming. Streamed, it answers OpenAI's event
sequence (`event: <type>` + `data: <json>`, each with a sequence_number): response.created,
response.in_progress, per output item its added / delta / done events, then
response.completed, or response.incomplete (max_output_tokens reached, or cancelled), or an
error event and response.failed when the mesh fails mid-stream. A stored response (`store`,
the default) can be cancelled while it runs: its backend call is closed (aborting it in the
mesh) and it ends with status "cancelled".
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time

from aiohttp import web

from services.common.logging import request_context
from services.gateway import observe
from services.gateway import responses_protocol as rp
from services.gateway.backend import BackendError
from services.gateway.errors import NOT_FOUND, APIError, from_backend, invalid
from services.gateway.limits import TOKENS_USED, check_caps
from services.gateway.openai_protocol import decode_json, parse_chat
from services.gateway.responses_store import RESPONSES, ResponseStore, Stored
from services.gateway.routes import merged
from services.gateway.shaping import Collector
from services.gateway.sse import EventStream
from services.gateway.state import STATE, GatewayState

log = logging.getLogger(__name__)
responses_routes = web.RouteTableDef()


def _not_found(rid: str, param: str) -> APIError:
    return APIError(404 if param == "response_id" else 400,
                    f"no stored response has the id {rid!r}: it never existed, was created with store=false, or "
                    "expired (--responses-store-ttl-s) or was evicted (--responses-store-size)", NOT_FOUND
                    if param == "response_id" else "invalid_request_error", param=param, code="response_not_found")


def _chat_error(e: APIError) -> APIError:
    """A parse_chat error, its parameter renamed to the Responses one."""
    ours = rp.chat_param(e.param)
    if ours != e.param and e.param:
        e.message = e.message.replace(e.param.split(".")[0].split("[")[0], ours.split(".")[0], 1) \
            if ours in ("max_output_tokens", "input") else e.message.replace("response_format", "text.format")
        e.param = ours
    return e


@responses_routes.post("/v1/responses")
async def create(request: web.Request) -> web.StreamResponse:
    state: GatewayState = request.app[STATE]
    store: ResponseStore = request.app[RESPONSES]
    config = state.config
    info = await state.require_info()
    body = rp.validated(decode_json(await request.read()))
    history: list[dict] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        before = store.get(prev)
        if before is None:
            raise _not_found(prev, "previous_response_id")
        if before.running:
            raise invalid(f"the response {prev!r} is still in progress: continue it once it has ended",
                          param="previous_response_id")
        history = before.messages
    messages = rp.input_messages(body)
    chat = rp.to_chat(body, history, messages)
    try:
        req = parse_chat(chat, info, state.served_names, config.max_tokens_default(False))
        check_caps(req, chat, config.max_n, config.max_stop, config.max_tokens_limit)
    except APIError as e:
        raise _chat_error(e) from None
    rid = rp.new_id("resp")
    entry = Stored(rp.response_object(rid, body, req.model), [*history, *messages])
    with request_context(rid):
        t0 = time.monotonic()
        async with contextlib.aclosing(merged(state.backend, req.calls)) as events:
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise BackendError("INTERNAL", "the backend ended the request without a result") from None
            metrics = request.app[observe.METRICS]
            observe.generation_started(req, state.served_name, t0, metrics)
            if body.get("store") is not False:
                store.put(entry)
            run = _Run(req, entry)
            try:
                if body.get("stream"):
                    response = await _stream(request, run, first, events, state)
                else:
                    await run.until_end(first, events, None)
                    response = web.json_response(entry.response, dumps=_dumps)
            finally:
                request[TOKENS_USED] = run.col.usage()["total_tokens"]
                entry.ended.set()
            if run.col.done:
                observe.generation_done(run.col, state.served_name, metrics)
        log.info("done", extra={"route": "responses", "stream": bool(body.get("stream")),
                                "seconds": round(time.monotonic() - t0, 4), **run.col.usage()})
        return response


class _Run:
    """One response's generation: backend events → output items (and their stream events)."""

    def __init__(self, req, entry: Stored) -> None:
        self.req, self.entry = req, entry
        self.col = Collector(req)
        self.tools = self.col.tool_streams[0] if self.col.tool_streams is not None else None
        self.out = rp.OutputBuilder()
        self.cancelled = False

    def add(self, i: int, batch: list) -> list[dict]:
        evs = []
        for event in batch:
            self.col.add(i, event)
            if not event.finished and event.text:
                for delta in self.tools.feed(event.text) if self.tools is not None else [{"content": event.text}]:
                    evs += self.out.feed(delta)
        return evs

    def end(self) -> list[dict]:
        """The last items' events; the response finished (completed, incomplete or cancelled)."""
        evs = []
        for delta in self.tools.finish() if self.tools is not None else []:
            evs += self.out.feed(delta)
        evs += self.out.close()
        reason = self.col.choices[0].finish_reason
        rp.finish(self.entry.response, self.out.items, self.col.usage(), reason.value if reason else "abort",
                  self.cancelled)
        self.entry.messages.append(rp.assistant_message(self.out.items))
        return evs

    async def until_end(self, first, events, send) -> None:
        """Feed every event (each batch's stream events to `send`, if given) until the last one
        or a cancel; then the closing events."""
        async def consume() -> None:
            for i, batch in [first]:
                evs = self.add(i, batch)
                if send is not None and evs:
                    await send(evs)
            async for i, batch in events:
                evs = self.add(i, batch)
                if send is not None and evs:
                    await send(evs)

        task = asyncio.ensure_future(consume())
        cancel = asyncio.ensure_future(self.entry.cancel.wait())
        try:
            await asyncio.wait({task, cancel}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancel.cancel()
            if not task.done():
                task.cancel()
                self.cancelled = self.entry.cancel.is_set()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # re-raises a BackendError or a failed write
        if self.cancelled:
            await events.aclose()  # aborts the backend call
        evs = self.end()
        if send is not None and evs:
            await send(evs)


async def _stream(request: web.Request, run: _Run, first, events, state: GatewayState) -> web.StreamResponse:
    stream = EventStream(request)
    seq = 0

    async def send(evs: list[dict]) -> None:
        nonlocal seq
        frames = []
        for ev in evs:
            ev["sequence_number"] = seq
            seq += 1
            frames.append(f"event: {ev['type']}\ndata: {_dumps(ev)}\n\n".encode())
        await stream.open()
        await stream.response.write(b"".join(frames))

    response = run.entry.response
    try:
        await send([{"type": "response.created", "response": copy.deepcopy(response)},
                    {"type": "response.in_progress", "response": copy.deepcopy(response)}])
        try:
            await run.until_end(first, events, send)
        except BackendError as e:
            log.warning("failed mid-stream", extra={"code": e.code, "error": e.message})
            err = from_backend(e, state.config.retry_after_s)
            response.update(status="failed", error={"code": err.code, "message": err.message})
            await send([{"type": "error", "code": err.code, "message": err.message, "param": None},
                        {"type": "response.failed", "response": copy.deepcopy(response)}])
        else:
            done = "response.completed" if response["status"] == "completed" else "response.incomplete"
            await send([{"type": done, "response": copy.deepcopy(response)}])
        await stream.response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected mid-stream")
    return stream.response


@responses_routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    entry = request.app[RESPONSES].get(rid)
    if entry is None:
        raise _not_found(rid, "response_id")
    return web.json_response(entry.response, dumps=_dumps)


@responses_routes.post("/v1/responses/{response_id}/cancel")
async def cancel(request: web.Request) -> web.Response:
    """Stops a stored response in progress and answers it, cancelled; a cancelled one again as
    it is; one that ended otherwise is a 400."""
    rid = request.match_info["response_id"]
    entry = request.app[RESPONSES].get(rid)
    if entry is None:
        raise _not_found(rid, "response_id")
    if entry.running:
        entry.cancel.set()
        await entry.ended.wait()
    elif entry.response["status"] != "cancelled":
        raise invalid(f"the response {rid!r} has ended ({entry.response['status']}): only one in progress can be "
                      "cancelled", param="response_id", code="response_not_cancellable")
    return web.json_response(entry.response, dumps=_dumps)


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)
