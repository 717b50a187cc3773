"""The Responses API's memory: stored responses, bounded in count and age.

A response created with `store` (the default) is kept here from its start: while it runs, so
`POST /v1/responses/{id}/cancel` can stop it and `GET` shows it in progress; once it ends, with
the conversation that produced it, so `previous_response_id` can continue it. At most
--responses-store-size entries (the oldest goes first) for at most --responses-store-ttl-s
seconds each (an expired one is gone: GET and previous_response_id then answer 404). Per
gateway process and in memory only: behind several gateways a client must reach the same one.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Stored:
    response: dict  # the Responses object as GET answers it (updated in place while it runs)
    messages: list[dict] = field(default_factory=list)  # the chat conversation, the output's turn last
    cancel: asyncio.Event = field(default_factory=asyncio.Event)  # set by /cancel while it runs
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when it stops running
    expires: float = 0.0

    @property
    def running(self) -> bool:
        return self.response["status"] in ("queued", "in_progress")


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size, self.ttl_s, self._clock = max_size, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, entry: Stored) -> None:
        """Adds (or refreshes) an entry under its response's id; evicts the oldest beyond max_size."""
        self._expire()
        rid = entry.response["id"]
        entry.expires = self._clock() + self.ttl_s
        self._items[rid] = entry
        self._items.move_to_end(rid)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        """The entry, or None when it was never stored, was evicted or expired."""
        self._expire()
        return self._items.get(rid)

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            rid, entry = next(iter(self._items.items()))
            if entry.expires > now:
                break  # entries are in expiry order: put() moves a refreshed one to the end
            del self._items[rid]


RESPONSES = web.AppKey("radixmesh_responses_store", ResponseStore)
