"""The paged KV pool: one flat slot array per layer, addressed by slot index.

Slot s belongs to page s // page_size. The scheduler hands out pages; the
worker turns (page table, position) into slots and reads/writes through index
tensors, so no Python runs per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.model.config import ModelConfig


@dataclass(frozen=True)
class KVPoolSpec:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @classmethod
    def from_budget(cls, config: ModelConfig, page_size: int, dtype: torch.dtype,
                    budget_bytes: int | None, mem_fraction: float | None) -> "KVPoolSpec":
        """Size the pool from a byte budget or, when none, a fraction of available memory."""
        probe = cls(1, page_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
        if budget_bytes is None:
            if mem_fraction is None or not 0 < mem_fraction < 1:
                raise ValueError(f"kv mem fraction must be in (0, 1), got {mem_fraction}")
            budget_bytes = int(available_memory_bytes() * mem_fraction)
        num_pages = budget_bytes // (probe.bytes_per_token * page_size)
        if num_pages < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds fewer than 2 pages of {page_size} tokens "
                f"({probe.bytes_per_token} bytes per token): raise --kv-cache-bytes")
        return cls(num_pages, page_size, probe.num_layers, probe.num_kv_heads, probe.head_dim, dtype)


def available_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class KVPool:
    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu"):
        self.spec = spec
        shape = (spec.num_layers, spec.num_slots, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)  # [L, S, Hkv, D]
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] int64; k, v [T, Hkv, D]."""
        self.k[layer].index_copy_(0, slots, k.to(self.spec.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.spec.dtype))
