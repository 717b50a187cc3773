"""One streamed OpenAI request → RequestResult. Errors are recorded, never raised.

Timing: `start` is taken just before the POST; each SSE line is stamped when aiohttp hands it
over. A *content event* is a chunk whose choice carries text (completions `text`, chat
`delta.content`); `events` holds their times. Output tokens come from the final usage
(`stream_options.include_usage`); a server that sends no usage gets the number of content events
instead (`usage_reported` False), which undercounts when a chunk carries several tokens.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestResult:
    start: float = 0.0
    end: float = 0.0
    events: list[float] = field(default_factory=list)
    text: str = ""
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    spec_draft_tokens: int | None = None     # usage.speculative (radixmesh's extra), when the request speculated
    spec_accepted_tokens: int | None = None
    usage_reported: bool = False
    done: bool = False            # [DONE] seen
    conversation: int = 0
    turn: int = 0
    expected_input_len: int = 0

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.start if self.events else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (output tokens − 1): the time per token after the first."""
        if not self.events or self.output_tokens < 2:
            return None
        return (self.end - self.events[0]) / (self.output_tokens - 1)


def feed_line(res: RequestResult, t: float, raw: bytes) -> None:
    """Consume one SSE line received at time t."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return
    data = line[5:].strip()
    if data == b"[DONE]":
        res.done, res.end = True, t
        return
    obj = json.loads(data)
    if obj.get("error"):
        err = obj["error"]
        raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    usage = obj.get("usage")
    if usage:
        res.usage_reported = True
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
        spec = usage.get("speculative") or {}
        if spec.get("draft_tokens") is not None:
            res.spec_draft_tokens, res.spec_accepted_tokens = int(spec["draft_tokens"]), int(spec["accepted_tokens"])
    for choice in obj.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            res.events.append(t)
            res.text += text
    res.end = t


class StreamError(Exception):
    """An error event inside a stream that began with 200."""


def finish(res: RequestResult) -> RequestResult:
    """Decide ok/error once the stream ended."""
    if res.error is None and not res.done:
        res.error = "the stream ended without [DONE]"
    if res.error is None and not res.events:
        res.error = "no output"
    if not res.usage_reported:
        res.output_tokens = len(res.events)
    res.ok = res.error is None
    return res


def parse_recorded(start: float, lines: list[tuple[float, bytes]]) -> RequestResult:
    """A RequestResult from timestamped SSE lines (tests, recordings)."""
    res = RequestResult(start=start)
    try:
        for t, raw in lines:
            feed_line(res, t, raw)
    except (StreamError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return finish(res)


def request_body(model: str, *, prompt: str | None = None, messages: list[dict] | None = None,
                 max_tokens: int, temperature: float, ignore_eos: bool,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


async def send(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any],
               timeout_s: float) -> RequestResult:
    """POST body to /v1/chat/completions (when it has messages) or /v1/completions; stream it."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    res = RequestResult(start=time.perf_counter())
    try:
        async with session.post(base_url.rstrip("/") + route, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                async for raw in resp.content:
                    feed_line(res, time.perf_counter(), raw)
                    if res.done:
                        break
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, StreamError, ValueError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    if not res.done:
        res.end = time.perf_counter()
    return finish(res)


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first id of GET /v1/models. Raises RuntimeError with the reason."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {base_url}/v1/models: HTTP {r.status}: {(await r.text())[:200]}")
            return (await r.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, OSError) as e:
        raise RuntimeError(f"GET {base_url}/v1/models failed: {type(e).__name__}: {e}") from None
