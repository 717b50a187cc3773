"""Calls nothing waits for (an Abort to a peer whose answer changes nothing here): each is kept
referenced until it ends, so the event loop cannot drop it, and a failure is logged, not lost."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger(__name__)


class SideCalls:
    def __init__(self, what: str) -> None:
        self.what = what  # named in the log line of a failure
        self._tasks: set[asyncio.Future] = set()

    def start(self, call: Awaitable) -> None:
        task = asyncio.ensure_future(call)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed", self.what, extra={"error": str(task.exception())})
