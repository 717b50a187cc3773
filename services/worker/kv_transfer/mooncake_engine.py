"""KV transfer through Mooncake's transfer engine (PyPI mooncake-transfer-engine-non-cuda).

Both sides register their pool's k and v (k alone for a latent pool) with the engine; the decode
descriptor carries its session id (host:rpc_port, reached by P2P handshake, no metadata server) and
the base addresses ("k_base", "v_base"); a send is one batched synchronous write of every page
run of every layer. The protocol is "tcp" unless RADIXMESH_MOONCAKE_PROTOCOL says otherwise
("rdma" where the machine has NICs for it; RADIXMESH_MOONCAKE_DEVICE then names them, e.g.
"mlx5_0"). Note that RDMA registration pins the whole pool, so it stops being lazily allocated.

`host` is the address peers reach this engine at: Mooncake binds its handshake listener there.

Quirks. Mooncake bounds a synchronous write by MC_TRANSFER_TIMEOUT (at least 5 s) plus 1 ns a
byte and spins a core while it waits; the write runs on a helper thread here so that send()
gives up after timeout_s (a write still in flight ends at Mooncake's own bound, and the next
send waits for it). It logs through glog to stderr: MC_LOG_LEVEL, read at import, defaults to
ERROR here (it knows no higher level), which still leaves a spurious "Local segment descriptor
not found" line per engine. Closing an engine takes about a second (Mooncake's destructor).
"""
from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from services.worker.kv_pool import KVPool
from services.worker.kv_transfer.engine import KVTransferError, no_descriptor
from services.worker.kv_transfer.layout import PoolLayout, make_descriptor, plan_send

INSTALL_HINT = ("install Debian's libibverbs1 (apt-get install libibverbs1) and the wheel "
                "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)")


@contextlib.contextmanager
def _env(**values: str):
    """os.environ with `values` set while Mooncake reads its settings (at import, in its constructor)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine_class() -> type:
    try:
        # Its INFO lines (a dozen per engine) go to stderr unless MC_LOG_LEVEL, read at import, says otherwise.
        with _env(MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR")):
            from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:
        raise KVTransferError(f"the mooncake KV transfer backend cannot load its library "
                              f"mooncake.engine ({e}): {INSTALL_HINT}") from e
    return TransferEngine


class MooncakeTransferEngine:
    backend = "mooncake"
    decode_storage = None  # any registered host memory will do

    def __init__(self, pool: KVPool, role: str, host: str = "127.0.0.1", timeout_s: float = 30.0,
                 protocol: str | None = None, device: str | None = None):
        cls = _engine_class()
        self.pool, self.layout, self.timeout_s = pool, PoolLayout.of(pool), timeout_s
        self.protocol = protocol or os.environ.get("RADIXMESH_MOONCAKE_PROTOCOL", "tcp")
        device = device if device is not None else os.environ.get("RADIXMESH_MOONCAKE_DEVICE", "")
        with _env(MC_TRANSFER_TIMEOUT=str(max(5, math.ceil(timeout_s)))):  # read by its constructor
            self._te = cls()
            if self._te.initialize(host, "P2PHANDSHAKE", self.protocol, device) != 0:
                raise KVTransferError(f"mooncake transfer engine failed to start on {host} over "
                                      f"{self.protocol!r} (its log above says why)")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._buffers = [(t.data_ptr(), t.numel() * t.element_size()) for t in pool.tensors]  # (address, bytes)
        for ptr, size in self._buffers:
            if self._te.register_memory(ptr, size) != 0:
                raise KVTransferError(f"mooncake {self.session} failed to register {size} bytes of KV pool "
                                      f"over {self.protocol!r}")
        self._role = role
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mooncake-send")

    def descriptor(self) -> str:
        if self._role != "decode" or self._te is None:
            raise no_descriptor(self.backend)
        bases = {f"{name}_base": ptr for name, (ptr, _) in zip(self.layout.tensor_names, self._buffers)}
        return make_descriptor(self.backend, f"mooncake://{self.session}", self.layout,
                               session=self.session, protocol=self.protocol, **bases)

    def send(self, descriptor: str, src_pages: list[int], dst_pages: list[int]) -> int:
        desc, runs = plan_send(descriptor, self.backend, self.layout, src_pages, dst_pages)
        if self._te is None:
            raise KVTransferError(f"send to {desc['peer']}: this mooncake engine is closed")
        if desc.get("protocol") != self.protocol:
            raise KVTransferError(f"receiver {desc['peer']} speaks {desc.get('protocol')!r}, "
                                  f"this engine {self.protocol!r}")
        if not runs:
            return 0
        srcs, dsts, lengths = [], [], []
        lb, pb = self.layout.layer_bytes, self.layout.page_bytes
        remote_lb = PoolLayout(**desc["layout"]).layer_bytes
        remotes = [desc[f"{name}_base"] for name in self.layout.tensor_names]  # same_format: the same names
        for (base, _), remote in zip(self._buffers, remotes):
            for layer in range(self.layout.num_layers):
                for run in runs:
                    srcs.append(base + layer * lb + run.src * pb)
                    dsts.append(remote + layer * remote_lb + run.dst * pb)
                    lengths.append(run.count * pb)
        write = self._writer.submit(self._te.batch_transfer_sync_write, desc["session"], srcs, dsts, lengths)
        try:
            status = write.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise KVTransferError(f"KV transfer to {desc['peer']} did not finish within {self.timeout_s} s") from None
        if status != 0:
            raise KVTransferError(f"KV transfer to {desc['peer']} failed: mooncake batch write returned {status} "
                                  "(receiver gone or unreachable; its log above says more)")
        return sum(lengths)

    def close(self) -> None:
        if self._te is None:
            return
        self._writer.shutdown(wait=True)  # a write in flight reads our pool: let it end first
        for ptr, _ in self._buffers:
            self._te.unregister_memory(ptr)
        self._te = None  # its destructor closes the listener and the sessions
