"""The async KV store client the scheduler and worker call: batched, bounded in time, never raising.

    client = KVStoreClient("127.0.0.1:50056", PageSpec.from_pool(pool.spec))
    hasher = PageHasher(KeyNamespace(model=..., weights_version=..., adapter=...,
                                     page_size=pool.spec.page_size, kv_layout=client.spec.layout))
    keys = hasher.keys(token_ids)                     # one key per full page
    n = await client.exists(keys)                     # scheduler: n * page_size tokens are stored
    n = await client.exists(keys, wait_s=0.5, claim_from=0)  # ... or wait for pages others are writing,
                                                      # and claim those this caller will write
    pages = await client.get_prefix(keys[:n])         # worker: [m, L, 2, P, Hkv, D], m <= n
    stored = await client.put(keys, pages_tensor)     # worker: write-through / write-back
    await client.close()

Failure model: the store is an optimization, so a store that is down, slow or
broken makes calls return misses (exists → 0, get → None/shorter prefix) or
no-ops (put → 0), with a warning log line when it goes down, one when it comes
back, and counters (`client.counters`). After a failure the client does not
call again for `retry_interval_s` (calls return at once: the request path
never waits on a dead store twice in a row); then the next call probes it.
gRPC reconnects underneath, its backoff capped at the same interval.

`exists(..., wait_s, claim_from)` takes part in claims (services/kvstore/claims.py):
it may wait up to wait_s for pages another client claimed, and claims what it will
write itself; its deadline grows by wait_s. Each client has its own id (`client_id`).

One client per event loop (its gRPC channel binds to the loop of its first
call); calls from that loop may run concurrently.

Deadlines grow with the bytes moved: timeout_s + bytes / min_bytes_per_s.
A batch above `max_batch_bytes` goes over the streamed RPC (PutStream,
GetStream), so no message crosses the 64 MB gRPC limit. Encoding and decoding
of batches above 1 MB run on a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from protos.radixmesh.v1 import kvstore_pb2 as pb
from protos.radixmesh.v1 import kvstore_pb2_grpc
from services.common import tls
from services.common.page_hash import PageHasher
from services.kvstore import page_codec
from services.kvstore.auth import bearer
from services.kvstore.claims import ProbeOptions
from services.kvstore.page_codec import PageSpec

log = logging.getLogger(__name__)

_OFFLOAD_BYTES = 1 << 20  # encode/decode on a thread above this


@dataclass
class ClientCounters:
    calls: int = 0
    failures: int = 0         # calls that failed (error, timeout); each returned a miss / no-op
    skipped: int = 0          # calls answered with a miss at once because the store was down
    pages_put: int = 0        # pages the store reported as newly stored
    pages_got: int = 0        # pages returned and decoded
    bytes_put: int = 0        # payload bytes sent by put
    bytes_got: int = 0        # payload bytes received by get
    bad_pages: int = 0        # returned pages of the wrong size (read as misses)


class KVStoreClient:
    def __init__(self, address: str, spec: PageSpec, *, timeout_s: float = 2.0,
                 retry_interval_s: float = 1.0, max_batch_bytes: int = 4 << 20,
                 min_bytes_per_s: float = 200e6, auth_token: str | None = None) -> None:
        """auth_token: the store's fleet (or admin) token, sent as `authorization: Bearer` on every call."""
        if timeout_s <= 0 or retry_interval_s < 0 or max_batch_bytes <= 0 or min_bytes_per_s <= 0:
            raise ValueError("timeout_s, max_batch_bytes and min_bytes_per_s must be > 0, retry_interval_s >= 0")
        self.address, self.spec = address, spec
        self.timeout_s, self.retry_interval_s = timeout_s, retry_interval_s
        self.max_batch_bytes, self.min_bytes_per_s = max_batch_bytes, min_bytes_per_s
        self.counters = ClientCounters()
        self.client_id = uuid.uuid4().hex  # whose claims are whose, at the store
        self._metadata = bearer(auth_token)
        self._down_until: float | None = None  # monotonic time; None = believed up
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None

    # -- connection and failure handling ---------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the client is backing off after a failure."""
        return self._down_until is None

    def _get_stub(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:  # created lazily: an aio channel binds to the running loop
            backoff_ms = max(100, int(self.retry_interval_s * 1000))
            self._channel = tls.aio_channel(self.address, options=[  # TLS when the process is configured
                ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", backoff_ms), ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", backoff_ms)])
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        return self._stub

    def _begin(self) -> bool:
        """Whether to make a call now (False: the store is down, answer with a miss)."""
        self.counters.calls += 1
        if self._down_until is not None and time.monotonic() < self._down_until:
            self.counters.skipped += 1
            return False
        return True

    def _ok(self) -> None:
        if self._down_until is not None:
            log.info("kvstore reachable again", extra={"address": self.address})
            self._down_until = None

    def _failed(self, what: str, e: BaseException) -> None:
        self.counters.failures += 1
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else repr(e)
        if self._down_until is None:
            log.warning("kvstore call failed; answering misses", extra={
                "address": self.address, "call": what, "error": detail, "retry_in_s": self.retry_interval_s})
        self._down_until = time.monotonic() + self.retry_interval_s

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_bytes_per_s

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    # -- the scheduler's side -------------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes], *, wait_s: float = 0.0, claim_from: int | None = None) -> int:
        """How many leading keys are stored (0 when the store is unreachable). wait_s > 0:
        when the stored prefix stops at a key another client claimed, wait up to wait_s
        for it to land. claim_from: this client will Put keys[max(answer, claim_from):]."""
        if not keys or not self._begin():
            return 0
        options = ProbeOptions(self.client_id, wait_s, claim_from)
        try:
            r = await self._get_stub().Exists(pb.ExistsRequest(keys=keys),
                                              timeout=self._deadline(32 * len(keys)) + options.wait_s,
                                              metadata=(*self._metadata, *options.metadata()))
        except Exception as e:  # noqa: BLE001 - never into the request path
            self._failed("Exists", e)
            return 0
        self._ok()
        return min(r.prefix_pages, len(keys))

    async def stored_prefix_tokens(self, hasher: PageHasher, token_ids: Sequence[int]) -> int:
        """How many leading tokens of token_ids have their KV in the store (a multiple of the page size)."""
        return await self.exists(hasher.keys(token_ids)) * hasher.page_size

    # -- the worker's side ----------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes], pages: torch.Tensor | Sequence[torch.Tensor]) -> int:
        """Store pages [N, L, 2, P, Hkv, D] under keys (N of them); returns how many were
        new (0 when the store is unreachable). Raises ValueError on a shape/dtype or count
        mismatch: that is a caller bug, not a store failure."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if not keys:
            return 0
        nbytes = len(keys) * self.spec.nbytes
        if nbytes > _OFFLOAD_BYTES:
            payloads = await asyncio.to_thread(self._encode_all, pages)
        else:
            payloads = self._encode_all(pages)
        if not self._begin():
            return 0
        batches = [pb.PutPagesRequest(pages=[pb.Page(key=k, data=d) for k, d in zip(keys[i:i + n], payloads[i:i + n])])
                   for i, n in self._chunks(len(keys))]
        try:
            stub = self._get_stub()
            if len(batches) == 1:
                r = await stub.Put(batches[0], timeout=self._deadline(nbytes), metadata=self._metadata)
            else:
                r = await stub.PutStream(iter(batches), timeout=self._deadline(nbytes), metadata=self._metadata)
        except Exception as e:  # noqa: BLE001
            self._failed("Put", e)
            return 0
        self._ok()
        self.counters.pages_put += r.stored
        self.counters.bytes_put += nbytes
        return r.stored

    def _encode_all(self, pages: torch.Tensor | Sequence[torch.Tensor]) -> list[bytes]:
        return [page_codec.encode(p, self.spec) for p in pages]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        per = max(1, self.max_batch_bytes // self.spec.nbytes)
        return [(i, min(per, n - i)) for i in range(0, n, per)]

    async def get(self, keys: Sequence[bytes], *, stop_at_miss: bool = True) -> list[torch.Tensor | None]:
        """Pages aligned with keys, None for a miss (all None when the store is
        unreachable). With stop_at_miss (the default: a chain is only usable up to
        its first gap) every page after the first miss is None as well. The pages
        are views into one fresh tensor."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        indices, pages = await self._fetch(keys, stop_at_miss)
        for row, i in enumerate(indices):
            out[i] = pages[row]
        return out

    async def get_prefix(self, keys: Sequence[bytes]) -> torch.Tensor:
        """The longest stored prefix of a chain as one fresh tensor [m, L, 2, P, Hkv, D]
        (m = 0 on a miss or when the store is unreachable)."""
        indices, pages = await self._fetch(keys, stop_at_miss=True)
        return pages  # with stop_at_miss the rows are keys 0..m-1, in order

    async def _fetch(self, keys: Sequence[bytes], stop_at_miss: bool) -> tuple[list[int], torch.Tensor]:
        """(the indices of the keys found, their pages [len(indices), ...] in that order)."""
        empty = torch.empty((0, *self.spec.shape), dtype=self.spec.dtype)
        if not keys or not self._begin():
            return [], empty
        nbytes = len(keys) * self.spec.nbytes
        request = pb.GetPagesRequest(keys=keys, stop_at_miss=stop_at_miss, max_batch_bytes=self.max_batch_bytes)
        found: dict[int, bytes] = {}
        try:
            stub = self._get_stub()
            if nbytes <= self.max_batch_bytes:
                responses = [await stub.Get(request, timeout=self._deadline(nbytes), metadata=self._metadata)]
            else:
                responses = [r async for r in stub.GetStream(request, timeout=self._deadline(nbytes),
                                                                 metadata=self._metadata)]
            for r in responses:
                for p in r.pages:
                    if p.index < len(keys) and p.key == keys[p.index]:
                        found[p.index] = p.data
        except Exception as e:  # noqa: BLE001
            self._failed("Get", e)
            return [], empty
        self._ok()
        indices = sorted(found)
        if stop_at_miss:  # only the run of hits from the first key on is usable
            indices = [i for n, i in enumerate(indices) if i == n]
        payloads = [found[i] for i in indices]
        if nbytes > _OFFLOAD_BYTES:
            pages, ok = await asyncio.to_thread(page_codec.decode_batch, payloads, self.spec)
        else:
            pages, ok = page_codec.decode_batch(payloads, self.spec)
        self.counters.bad_pages += ok.count(False)
        if stop_at_miss and not all(ok):
            m = ok.index(False)
            indices, pages = indices[:m], pages[:m]
        elif not all(ok):
            rows = [r for r, good in enumerate(ok) if good]
            indices, pages = [indices[r] for r in rows], pages[rows]
        self.counters.pages_got += len(indices)
        self.counters.bytes_got += len(indices) * self.spec.nbytes
        return indices, pages

    # -- admin ----------------------------------------------------------------------------------

    async def clear(self) -> int | None:
        """Empties the store; the number of pages removed, None when unreachable."""
        if not self._begin():
            return None
        try:
            r = await self._get_stub().Clear(pb.ClearRequest(), timeout=max(self.timeout_s, 30.0),
                                             metadata=self._metadata)
        except Exception as e:  # noqa: BLE001
            self._failed("Clear", e)
            return None
        self._ok()
        return r.pages_removed

    async def stats(self) -> pb.KVStoreStats | None:
        if not self._begin():
            return None
        try:
            r = await self._get_stub().Stats(pb.KVStoreStatsRequest(), timeout=self.timeout_s, metadata=self._metadata)
        except Exception as e:  # noqa: BLE001
            self._failed("Stats", e)
            return None
        self._ok()
        return r
