"""KV transfer through shared memory: the same host, no socket, one copy per page run.

A decode worker builds its pool with shm_zeros (registry.pool_storage gives it), so its k and
v (k alone for a latent pool, whose v is zero-width) are files under /dev/shm mapped MAP_SHARED:
sparse, costing memory only for the pages written, like pool_zeros. The decode engine finds
those files in /proc/self/maps, holds an exclusive flock on k's file while it serves (a
sender's liveness probe: a shared lock that succeeds means no receiver holds the pool any more)
and unlinks them on close. A sender maps the files a descriptor names, once per descriptor, and
copies its pages straight into them. A copy cannot stall, so timeout_s bounds nothing here.
"""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass

import torch

from services.worker.kv_pool import KVPool
from services.worker.kv_transfer.engine import KVTransferError, no_descriptor
from services.worker.kv_transfer.layout import PoolLayout, make_descriptor, plan_send

SHM_DIR = "/dev/shm"
FILE_PREFIX = "radixmesh-kv-"


def shm_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a new /dev/shm file (a KVPool storage). The file is unlinked by
    the decode engine's close, or when the tensor's memory is freed or the process exits."""
    nbytes = math.prod(shape) * dtype.itemsize
    _check_room(nbytes)
    path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # sparse: tmpfs allocates a page when it is first written
        buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    weakref.finalize(buffer, _unlink, path)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def _check_room(nbytes: int) -> None:
    """A write past a full tmpfs is a SIGBUS, not an error: refuse a pool it cannot hold now."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise KVTransferError(f"{SHM_DIR} has {free} bytes free, a shared KV pool tensor needs {nbytes}: "
                              "give the container more (docker --shm-size) or the pool fewer pages")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file mapped at the start of `tensor`'s memory, from /proc/self/maps (None: anonymous)."""
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) == 6 and ptr == lo else None
    return None


@dataclass
class _Peer:
    """A receiver's pool, mapped: its tensors (k, v or k alone) uint8 [L, pages, page_bytes]; lock_fd
    (on k's file) probes liveness."""
    tensors: tuple[torch.Tensor, ...]
    lock_fd: int


def _page_bytes_view(t: torch.Tensor, layout: PoolLayout) -> torch.Tensor:
    return t.view(torch.uint8).reshape(layout.num_layers, layout.num_pages, layout.page_bytes)


def _open_peer(desc: dict, layout: PoolLayout) -> _Peer:
    """Map the files the descriptor names, one a tensor of the layout ("k", "v" or "k" alone)."""
    tensors, fds = [], []
    try:
        for path in (desc[name] for name in layout.tensor_names):
            try:
                fds.append(os.open(path, os.O_RDWR))
            except FileNotFoundError:
                raise KVTransferError(f"receiver {desc['peer']}: {path} does not exist (the shm backend needs a live "
                                      "decode worker on this host, sharing its /dev/shm)") from None
            size = os.fstat(fds[-1]).st_size
            if size != layout.tensor_bytes:
                raise KVTransferError(f"receiver {desc['peer']}: {path} holds {size} bytes, its layout "
                                      f"[{layout.describe()}] {layout.tensor_bytes}")
            buffer = mmap.mmap(fds[-1], size, mmap.MAP_SHARED)
            tensors.append(_page_bytes_view(torch.frombuffer(buffer, dtype=torch.uint8), layout))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in fds[1:]:
        os.close(fd)
    return _Peer(tuple(tensors), fds[0])


class ShmTransferEngine:
    backend = "shm"
    decode_storage = staticmethod(shm_zeros)

    def __init__(self, pool: KVPool, role: str, host: str = "127.0.0.1", timeout_s: float = 30.0):
        self.pool, self.layout = pool, PoolLayout.of(pool)
        self._src = tuple(_page_bytes_view(t, self.layout) for t in pool.tensors)  # [L, pages, page_bytes] each
        self._peers: dict[str, _Peer] = {}
        self._files: tuple[str, ...] | None = None  # the pool's files, k's first
        self._lock_fd: int | None = None
        if role == "decode":
            self._serve()

    def _serve(self) -> None:
        files = tuple(mapped_file(t) for t in self.pool.tensors)
        if not all(f and f.startswith(SHM_DIR + "/") and not f.endswith("(deleted)") for f in files):
            raise KVTransferError(f"the decode pool is not in {SHM_DIR} files (mapped: {files}): build its KVPool "
                                  "with storage=pool_storage('shm', 'decode')")
        fd = os.open(files[0], os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise KVTransferError(f"another shm engine already serves the pool in {files[0]}") from None
        self._files, self._lock_fd = files, fd

    def descriptor(self) -> str:
        if self._files is None:
            raise no_descriptor(self.backend)
        files = dict(zip(self.layout.tensor_names, self._files))  # "k" (and "v") -> path
        return make_descriptor(self.backend, f"shm:pid {os.getpid()} ({files['k']})", self.layout, **files)

    def send(self, descriptor: str, src_pages: list[int], dst_pages: list[int]) -> int:
        desc, runs = plan_send(descriptor, self.backend, self.layout, src_pages, dst_pages)
        if not runs:
            return 0
        peer = self._peer(descriptor, desc)
        for run in runs:
            for src, dst in zip(self._src, peer.tensors):
                dst[:, run.dst:run.dst + run.count].copy_(src[:, run.src:run.src + run.count])  # [L, n, page_bytes]
        return self.layout.send_bytes(len(src_pages))

    def _peer(self, descriptor: str, desc: dict) -> _Peer:
        """The receiver's mapped pool, after checking a decode engine still holds it."""
        peer = self._peers.get(descriptor)
        if peer is None:
            peer = self._peers[descriptor] = _open_peer(desc, PoolLayout(**desc["layout"]))
        try:
            fcntl.flock(peer.lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return peer  # the receiver's exclusive lock stands: it is alive
        fcntl.flock(peer.lock_fd, fcntl.LOCK_UN)
        os.close(self._peers.pop(descriptor).lock_fd)
        raise KVTransferError(f"receiver {desc['peer']} is gone: no decode engine holds its pool")

    def close(self) -> None:
        for peer in self._peers.values():
            os.close(peer.lock_fd)
        self._peers.clear()
        if self._files is not None:
            for path in self._files:
                _unlink(path)
            os.close(self._lock_fd)  # releases the lock: senders see the receiver gone
            self._files, self._lock_fd = None, None
