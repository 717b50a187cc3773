"""Server-sent events framing: `data: <json>\\n\\n` per event, `data: [DONE]` last.

A write to a client that went away raises ConnectionResetError; callers let it
propagate so that the request's backend call is cancelled.
"""
from __future__ import annotations

import json

from aiohttp import web

DONE = b"data: [DONE]\n\n"
OPENED = web.RequestKey("radixmesh_sse_opened", bool)  # the stream's status line went out: no other answer now


def frame(obj: dict) -> bytes:
    """One event. JSON never contains a raw newline, so one `data:` line suffices."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class EventStream:
    """A text/event-stream response, opened lazily on the first send."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def open(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold events back
            })
            self.request[OPENED] = True
            await self.response.prepare(self.request)

    async def send(self, *objs: dict) -> None:
        """One write for all of `objs` (a step's events go out together)."""
        await self.open()
        await self.response.write(b"".join(frame(obj) for obj in objs))

    async def done(self) -> web.StreamResponse:
        await self.open()
        await self.response.write(DONE)
        await self.response.write_eof()
        return self.response
