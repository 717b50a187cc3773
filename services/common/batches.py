"""A stream of OutputBatch messages fed from a queue: what the scheduler's Outputs and the
detokenizer's Texts streams write (radixmesh.v2)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator


async def drain_batches(queue: asyncio.Queue) -> AsyncIterator:
    """The batches put on `queue` until a None. Those that piled up while the reader was busy
    come merged into one message (their repeated fields concatenated, in order)."""
    while True:
        batch = await queue.get()
        while batch is not None and not queue.empty():
            more = queue.get_nowait()
            if more is None:
                yield batch
                return
            batch.MergeFrom(more)
        if batch is None:
            return
        yield batch
