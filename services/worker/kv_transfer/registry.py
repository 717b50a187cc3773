"""KV transfer backends by name, imported on first use (mooncake loads a native library).

Adding one: a module with a class taking (pool, role, host, timeout_s) that implements
engine.KVTransferEngine and says, as `decode_storage`, what memory a decode pool needs
(a KVPool storage callable, or None for ordinary memory); then one line below.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from services.worker.kv_pool import KVPool
from services.worker.kv_transfer.engine import ROLES, KVTransferEngine

# name -> "module:class"
TRANSFER_BACKENDS = {
    "grpc": "services.worker.kv_transfer.grpc_engine:GrpcTransferEngine",  # the default: any host, a port
    "shm": "services.worker.kv_transfer.shm_engine:ShmTransferEngine",  # same host: /dev/shm, no socket
    "mooncake": "services.worker.kv_transfer.mooncake_engine:MooncakeTransferEngine",  # Mooncake TE: tcp or rdma
}


def backend_class(backend: str) -> type:
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; choose from {', '.join(sorted(TRANSFER_BACKENDS))}")
    module, cls = TRANSFER_BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), cls)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown KV transfer role {role!r}; choose from {', '.join(ROLES)}")


def create_engine(backend: str, pool: KVPool, role: str, host: str = "127.0.0.1",
                  timeout_s: float = 30.0) -> KVTransferEngine:
    """An engine over `pool`. role "decode" starts its receiving end (on `host`, the address
    senders reach); "prefill" only sends. A decode pool must come from pool_storage's memory."""
    _check_role(role)
    return backend_class(backend)(pool, role, host=host, timeout_s=timeout_s)


def pool_storage(backend: str, role: str) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None:
    """The KVPool storage callable a `role` pool needs under `backend` (the shm decode pool's
    /dev/shm files), or None for KVPool's default."""
    _check_role(role)
    return backend_class(backend).decode_storage if role == "decode" else None
