"""How much one caller may ask for: per-request caps and per-caller rate limits.

Caps (400 `invalid_request_error`, `param` naming the field): n above --max-n, more stop
strings than --max-stop, max_tokens (max_completion_tokens, /generate's max_new_tokens) above
--max-tokens-limit. They are checked on the parsed request, after the schema's own bounds
(n <= 16, 16 stop strings), which they may only tighten; a request that names no max_tokens
is capped by GatewayConfig.max_tokens_default instead.

Rate limits: a token bucket per caller (auth.KeyRing.caller: an API key, or the client
address when the gateway has no keys), holding a minute's worth and refilled continuously:
  requests  --rate-limit-rpm: each request takes one when it is admitted
  tokens    --rate-limit-tpm: a request is admitted unless the bucket is overdrawn, and charged
            its prompt + completion tokens (the usage it reports) when it ends, streamed or not,
            finished or cut off; the prompt's size is only known to the tokenizer, and a
            max_tokens charged up front would be the whole context for a request without one.
            One large request may overdraw the bucket: the caller then waits for the refill.
Over a limit: 429 with Retry-After (whole seconds until the bucket allows the request) and
OpenAI's error: type "requests" or "tokens", code rate_limit_exceeded.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from services.gateway.errors import APIError, invalid
from services.gateway.openai_protocol import ParsedRequest

TOKENS_USED = web.RequestKey("radixmesh_tokens_used", int)  # set by routes._serve, charged by the middleware
MAX_CALLERS = 4096  # buckets kept before full ones (callers that are owed nothing) are forgotten


@dataclass
class Bucket:
    capacity: float
    per_s: float
    level: float
    at: float

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now
        return self.level

    def wait_s(self, need: float) -> float:
        """Seconds until the level reaches `need` (after a refill)."""
        return max(0.0, (need - self.level) / self.per_s)


class RateLimiter:
    """Requests and tokens per minute per caller; either limit may be None (off)."""

    def __init__(self, rpm: int | None, tpm: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self._buckets: dict[str, dict[str, Bucket]] = {}

    @property
    def on(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def _of(self, caller: str, now: float) -> dict[str, Bucket]:
        buckets = self._buckets.get(caller)
        if buckets is None:
            if len(self._buckets) >= MAX_CALLERS:
                self._forget_full(now)
            buckets = self._buckets[caller] = {
                kind: Bucket(limit, limit / 60, limit, now)
                for kind, limit in (("requests", self.rpm), ("tokens", self.tpm)) if limit is not None}
        return buckets

    def _forget_full(self, now: float) -> None:
        for caller, buckets in list(self._buckets.items()):
            if all(b.refill(now) >= b.capacity for b in buckets.values()):
                del self._buckets[caller]

    def admit(self, caller: str, who: str = "this API key") -> None:
        """Take one request from `caller`'s buckets, or raise APIError 429 (nothing taken)."""
        if not self.on:
            return
        now = self.clock()
        buckets = self._of(caller, now)
        for kind, need in (("requests", 1.0), ("tokens", 0.0)):  # tokens: admitted unless overdrawn
            bucket = buckets.get(kind)
            if bucket is not None and bucket.refill(now) < need:
                retry = max(1, math.ceil(bucket.wait_s(need)))
                limit = self.rpm if kind == "requests" else self.tpm
                raise APIError(429, f"rate limit reached: {limit} {kind} per minute for {who}; retry in {retry} s",
                               kind, code="rate_limit_exceeded", retry_after=retry)
        if "requests" in buckets:
            buckets["requests"].level -= 1

    def charge(self, caller: str, tokens: int) -> None:
        """Take `tokens` from `caller`'s token bucket (it may go below zero)."""
        if self.tpm is None or tokens <= 0:
            return
        now = self.clock()
        bucket = self._of(caller, now)["tokens"]
        bucket.refill(now)
        bucket.level -= tokens


LIMITER = web.AppKey("radixmesh_gateway_limiter", RateLimiter)


def check_caps(req: ParsedRequest, body: dict, max_n: int, max_stop: int, max_tokens: int | None) -> None:
    """Raise a 400 APIError for the first cap the parsed request exceeds; `body` (decoded) names
    the parameter as the client sent it."""
    native = req.kind == "generate"
    prefix = "sampling_params." if native else ""
    if req.n > max_n:
        raise invalid(f"{prefix}n must be at most {max_n} on this server, got {req.n}", param=prefix + "n")
    for call in req.calls:
        sp = call.sampling
        if len(sp.stop) > max_stop:
            raise invalid(f"{prefix}stop may hold at most {max_stop} strings on this server, got {len(sp.stop)}",
                          param=prefix + "stop")
        # A request that names none was capped already (GatewayConfig.max_tokens_default).
        if max_tokens is not None and not call.fill_context and sp.max_new_tokens > max_tokens:
            name = ("max_new_tokens" if native else
                    "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
            raise invalid(f"{prefix}{name} must be at most {max_tokens} on this server, got {sp.max_new_tokens}",
                          param=prefix + name)
