"""KV transfer over gRPC, the default backend: works across hosts, needs nothing but a port.

The decode side serves KVReceiver (protos/radixmesh/v1/kv_transfer.proto) on host:0 from a
sync gRPC server's threads, writing each chunk straight into its pool. The sender gathers its
pages' bytes into chunks of at most 4 MiB (each a list of segments: layer, k or v, first
destination page, page count; a latent pool's tensor is always 0, k: it has no V to send) and
streams them under a deadline of timeout_s; the receiver answers once every byte is in place.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from protos.radixmesh.v1 import kv_transfer_pb2 as pb
from protos.radixmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from services.worker.kv_pool import KVPool
from services.worker.kv_transfer.engine import KVTransferError, no_descriptor
from services.worker.kv_transfer.layout import PageRun, PoolLayout, make_descriptor, plan_send

CHUNK_BYTES = 4 << 20  # payload per message: grpc's default receive limit, and enough to fill the pipe
RECEIVER_THREADS = 4  # concurrent senders a decode worker writes for at once


def page_arrays(pool: KVPool, layout: PoolLayout) -> tuple[np.ndarray, ...]:
    """The pool's tensors (k and v, or k alone if latent) as their bytes, uint8 [L, pages, page_bytes]
    views (FP8 and bf16 alike)."""
    shape = (layout.num_layers, layout.num_pages, layout.page_bytes)
    return tuple(t.view(torch.uint8).reshape(shape).numpy() for t in pool.tensors)


def _chunks(arrays: tuple[np.ndarray, ...], layout: PoolLayout, runs: list[PageRun]) -> Iterator[pb.KVChunk]:
    """The runs' pages, layer by layer, k then v (k alone if latent), packed into chunks of at most CHUNK_BYTES."""
    step = max(1, CHUNK_BYTES // layout.page_bytes)  # pages of one segment
    segments: list[pb.KVSegment] = []
    parts: list[np.ndarray] = []
    size, first = 0, True
    for run in runs:
        for off in range(0, run.count, step):
            n = min(step, run.count - off)
            src = run.src + off
            for layer in range(layout.num_layers):
                for tensor, array in enumerate(arrays):
                    if segments and size + n * layout.page_bytes > CHUNK_BYTES:
                        yield _chunk(segments, parts, layout if first else None)
                        segments, parts, size, first = [], [], 0, False
                    segments.append(pb.KVSegment(layer=layer, tensor=tensor, dst_page=run.dst + off, num_pages=n))
                    parts.append(array[layer, src:src + n].reshape(-1))
                    size += n * layout.page_bytes
    if segments:
        yield _chunk(segments, parts, layout if first else None)


def _chunk(segments: list[pb.KVSegment], parts: list[np.ndarray], layout: PoolLayout | None) -> pb.KVChunk:
    return pb.KVChunk(segments=segments, data=b"".join(parts),
                      layout=json.dumps(layout.to_dict()) if layout else "")


class _Receiver(pb_grpc.KVReceiverServicer):
    """Writes chunks into a pool, refusing any the pool cannot take."""

    def __init__(self, pool: KVPool, layout: PoolLayout):
        self.layout = layout
        self.arrays = page_arrays(pool, layout)

    def Write(self, request_iterator, context) -> pb.KVWriteAck:
        written = 0
        for chunk in request_iterator:
            if chunk.layout:
                self._check_layout(chunk.layout, context)
            written += self._write(chunk, context)
        return pb.KVWriteAck(bytes=written)

    def _check_layout(self, text: str, context) -> None:
        try:
            theirs = PoolLayout(**json.loads(text))
        except (ValueError, TypeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a KV pool layout: {text[:200]!r}")
        if not theirs.same_format(self.layout):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the sender's KV layout [{theirs.describe()}] "
                          f"is not this pool's [{self.layout.describe()}]")

    def _write(self, chunk: pb.KVChunk, context) -> int:
        lay, page_bytes = self.layout, self.layout.page_bytes
        data = chunk.data  # read once: each read of a bytes field may build a new bytes object
        segments = list(chunk.segments)
        total = sum(s.num_pages for s in segments) * page_bytes
        if total != len(data):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a chunk's segments name {total} bytes, it carries {len(data)}")
        for s in segments:
            if s.tensor >= len(self.arrays) or s.layer >= lay.num_layers or s.dst_page + s.num_pages > lay.num_pages:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"segment (layer {s.layer}, tensor {s.tensor}, pages "
                              f"{s.dst_page}+{s.num_pages}) is outside the pool [{lay.describe()}]")
        payload = np.frombuffer(data, np.uint8).reshape(-1, page_bytes)  # [pages in the chunk, page_bytes]
        row = 0
        for s in segments:
            self.arrays[s.tensor][s.layer, s.dst_page:s.dst_page + s.num_pages] = payload[row:row + s.num_pages]
            row += s.num_pages
        return total


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _advertised(host: str, port: int) -> str:
    """host:port a sender dials: a wildcard bind is advertised under this machine's name."""
    return _host_port(socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host, port)


class GrpcTransferEngine:
    backend = "grpc"
    decode_storage = None  # the decode pool lives in ordinary memory

    def __init__(self, pool: KVPool, role: str, host: str = "127.0.0.1", timeout_s: float = 30.0):
        self.pool, self.layout, self.timeout_s = pool, PoolLayout.of(pool), timeout_s
        self._arrays = page_arrays(pool, self.layout)
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.KVReceiverStub]] = {}
        self._server: grpc.Server | None = None
        self._address: str | None = None
        if role == "decode":
            self._serve(host)

    def _serve(self, host: str) -> None:
        limit = max(CHUNK_BYTES, self.layout.page_bytes) + (1 << 20)  # a chunk plus its segment list
        server = grpc.server(ThreadPoolExecutor(RECEIVER_THREADS, thread_name_prefix="kv-receiver"),
                             options=[("grpc.max_receive_message_length", limit)])
        pb_grpc.add_KVReceiverServicer_to_server(_Receiver(self.pool, self.layout), server)
        bind = _host_port(host, 0)
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise KVTransferError(f"KV receiver cannot bind {bind}: {e}") from None
        server.start()
        self._server, self._address = server, _advertised(host, port)

    def descriptor(self) -> str:
        if self._address is None:
            raise no_descriptor(self.backend)
        return make_descriptor(self.backend, f"grpc://{self._address}", self.layout, address=self._address)

    def send(self, descriptor: str, src_pages: list[int], dst_pages: list[int]) -> int:
        desc, runs = plan_send(descriptor, self.backend, self.layout, src_pages, dst_pages)
        expected = self.layout.send_bytes(len(src_pages))
        if not runs:
            return 0
        try:
            ack = self._stub(desc["address"]).Write(_chunks(self._arrays, self.layout, runs), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise KVTransferError(f"KV transfer to {desc['peer']} failed: {e.code().name}: {e.details()}") from None
        if ack.bytes != expected:
            raise KVTransferError(f"KV transfer to {desc['peer']}: the receiver wrote {ack.bytes} bytes of {expected}")
        return expected

    def _stub(self, address: str) -> pb_grpc.KVReceiverStub:
        if address not in self._channels:
            channel = grpc.insecure_channel(address)
            self._channels[address] = (channel, pb_grpc.KVReceiverStub(channel))
        return self._channels[address][1]

    def close(self) -> None:
        for channel, _ in self._channels.values():
            channel.close()
        self._channels.clear()
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server, self._address = None, None
