"""PD disaggregation's KV transfer: a prefill worker writes pages of its KV pool into a decode
worker's pool. The interface is engine.KVTransferEngine; backends are in registry.py."""
from services.worker.kv_transfer.engine import KVTransferEngine, KVTransferError
from services.worker.kv_transfer.registry import TRANSFER_BACKENDS, create_engine, pool_storage

__all__ = ["KVTransferEngine", "KVTransferError", "TRANSFER_BACKENDS", "create_engine", "pool_storage"]
