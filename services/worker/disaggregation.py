"""The worker's part in prefill/decode disaggregation (docs/disaggregation.md): its transfer
engine (services/worker/kv_transfer), and a plan's KVSends run after the forward.

A decode worker's pool lives in the memory its backend needs (shm: /dev/shm files a prefill
worker writes in place) and its engine's descriptor goes to the scheduler in WorkerInfo. A
prefill worker runs each send to completion before it answers the step, so a page is in
place at the decode side before its scheduler can report the room done, and no later step
can overwrite a page while it is read.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from services.step.contract import KVSend, KVSendResult
from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPool

log = logging.getLogger(__name__)


def is_disaggregated(config: WorkerConfig) -> bool:
    return config.disaggregation_mode != "null"


def decode_pool_storage(config: WorkerConfig) -> Callable | None:
    """The storage a KVPool needs on this worker (None: the ordinary kind)."""
    if config.disaggregation_mode != "decode":
        return None
    from services.worker.kv_transfer.registry import pool_storage
    return pool_storage(config.disaggregation_transfer_backend, "decode")


def check_device(config: WorkerConfig, device: torch.device) -> None:
    if is_disaggregated(config) and device.type != "cpu":
        raise ValueError(f"--disaggregation-mode {config.disaggregation_mode} moves pools in host memory; "
                         f"a {device.type} worker's pool is not supported yet")


class KVSender:
    """The worker's transfer engine and the sends of its plans."""

    def __init__(self, config: WorkerConfig, pool: KVPool) -> None:
        from services.worker.kv_transfer.registry import create_engine
        self.mode, self.backend = config.disaggregation_mode, config.disaggregation_transfer_backend
        self.engine = create_engine(self.backend, pool, self.mode, host=config.disaggregation_host,
                                    timeout_s=config.disaggregation_timeout_s)
        self.page_bytes = pool.spec.bytes_per_token * pool.spec.page_size

    def descriptor(self) -> str:
        """What a prefill worker sends to ("" on a prefill worker)."""
        return self.engine.descriptor() if self.mode == "decode" else ""

    def run(self, sends: list[KVSend]) -> list[KVSendResult]:
        """Each send to completion, in order; a failed one reports its error (its room fails)."""
        from services.worker.kv_transfer.engine import KVTransferError
        results = []
        for send in sends:
            t0 = time.perf_counter()
            try:
                moved = self.engine.send(send.descriptor, send.src_pages, send.dst_pages)
            except KVTransferError as e:
                log.warning("KV send failed", extra={"room": send.room, "error": str(e)})
                results.append(KVSendResult(send.room, error=str(e), seconds=time.perf_counter() - t0))
                continue
            results.append(KVSendResult(send.room, len(send.src_pages), moved, time.perf_counter() - t0))
        return results

    def close(self) -> None:
        self.engine.close()
