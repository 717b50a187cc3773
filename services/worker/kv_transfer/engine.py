"""The KV transfer interface of PD disaggregation: a prefill worker writes pages of its KV
pool into pages of a decode worker's pool, in another process, on this host or another.

The decode side creates an engine over its pool and publishes `descriptor()`; the prefill
side creates one over its own pool and calls `send(descriptor, src_pages, dst_pages)` after
the forward that wrote those pages. Who sends which pages when is decided above this layer
(the scheduler's handshake); an engine only moves bytes. Backends: registry.py.
"""
from __future__ import annotations

from typing import Protocol

ROLES = ("prefill", "decode")


class KVTransferError(RuntimeError):
    """A transfer that failed or could not start; the message names the peer and what failed."""


def no_descriptor(backend: str) -> KVTransferError:
    """What descriptor() raises on an engine that is not a serving decode side."""
    return KVTransferError(f"a prefill-side (or closed) {backend} engine has no descriptor: "
                           "create it with role='decode'")


class KVTransferEngine(Protocol):
    backend: str  # its name in registry.TRANSFER_BACKENDS

    def descriptor(self) -> str:
        """Decode side: JSON text telling a sender how to reach this pool (address, shared
        memory files or session and base addresses, and the pool's layout for a sanity check).
        A prefill-side engine has none: KVTransferError."""

    def send(self, descriptor: str, src_pages: list[int], dst_pages: list[int]) -> int:
        """Prefill side: copy this pool's src_pages into the receiver's dst_pages (every layer,
        k and v), runs of consecutive pages on both sides as one range a layer. Blocks until the
        bytes are in place at the receiver and returns how many moved. Raises KVTransferError on
        any failure, after the engine's timeout_s at the latest, and before moving anything when
        the receiver's layout (layers, heads, head_dim, page_size, dtype) differs from this
        pool's; after a failure the destination pages hold unspecified bytes. Called from one
        thread."""

    def close(self) -> None:
        """Frees sockets, servers and shared-memory files; idempotent."""
