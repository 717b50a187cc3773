"""The paged KV pool: one flat slot array per layer, addressed by slot index.

Slot s belongs to page s // page_size. The scheduler hands out pages; the
worker turns (page table, position) into slots and reads/writes through index
tensors, so no Python runs per token.

The pool's storage dtype is the model's, or an FP8 format (--kv-cache-dtype): one byte
per element, a stored byte meaning fp8_value * kv_scale (one scale per format, the same
for every layer, K and V), each head's row Hadamard-rotated before rounding
(kernels/kv_fp8.py). Writes rotate and round in the C++ extension when it is built, else
in torch, to the same bytes; the attention kernels widen and undo the rotation on the
query and output side.

An MLA model's pool (DeepSeek-V2/V3, services/worker/model/mla.py) is a latent pool
(KVPoolSpec.latent_dim > 0): one row per token and layer of kv_lora_rank + qk_rope_head_dim
elements, as one KV head, and no separate V (`v` is zero-width): attention reads V as the first
latent_dim columns of K. An FP8 latent row is rotated in blocks of hadamard_block(head_dim), which
must divide latent_dim, so V's columns are whole blocks (latent_rotation_refusal).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.host_memory import zeroed_host_tensor

from kernels.kv_fp8 import FP8_KV_SCALES, dequantize_kv, hadamard_block, quantize_kv  # noqa: F401 (re-exported)
from services.worker.model.config import ModelConfig


@dataclass(frozen=True)
class KVPoolSpec:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the storage dtype: the model's, or float8_e4m3fn / float8_e5m2
    # > 0: an MLA latent pool (num_kv_heads 1, head_dim kv_lora_rank + rope dims, V = K[..., :latent_dim])
    latent_dim: int = 0

    @property
    def is_latent(self) -> bool:
        return self.latent_dim > 0

    @property
    def v_head_dim(self) -> int:
        """The width of a stored V row: 0 in a latent pool (V is part of K's row)."""
        return 0 if self.is_latent else self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_KV_SCALES

    @property
    def kv_scale(self) -> float:
        """A stored element's value is its dtype's value times this (1.0 unless FP8)."""
        return FP8_KV_SCALES.get(self.dtype, 1.0)

    @property
    def dtype_name(self) -> str:
        """"bfloat16", "float8_e4m3fn", ...: the name logs, metrics and page identity use."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        """Every byte a token's KV takes (FP8: no per-token scales, so one byte an element)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots

    @classmethod
    def from_budget(cls, config: ModelConfig, page_size: int, dtype: torch.dtype,
                    budget_bytes: int | None, mem_fraction: float | None,
                    device: torch.device | str = "cpu") -> "KVPoolSpec":
        """Size the pool from a byte budget; when none, from a fraction of `device`'s free memory
        (taken after the weights are loaded), or by default_budget_bytes without either; dtype is the
        storage dtype, so an FP8 pool holds twice a bfloat16 one's tokens."""
        probe = cls.for_model(config, 1, page_size, dtype)
        if budget_bytes is None and mem_fraction is None:
            budget_bytes = default_budget_bytes(device)
        elif budget_bytes is None:
            if not 0 < mem_fraction < 1:
                raise ValueError(f"kv mem fraction must be in (0, 1), got {mem_fraction}")
            budget_bytes = int(available_memory_bytes(device) * mem_fraction)
        num_pages = budget_bytes // (probe.bytes_per_token * page_size)
        if num_pages < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds fewer than 2 pages of {page_size} tokens "
                f"({probe.bytes_per_token} bytes per token): raise --kv-cache-bytes")
        return dataclasses.replace(probe, num_pages=num_pages)

    @classmethod
    def for_model(cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype) -> "KVPoolSpec":
        """The pool `config`'s attention needs: its KV heads, or for MLA one latent row."""
        if not config.is_mla:
            return cls(num_pages, page_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                       dtype)
        spec = cls(num_pages, page_size, config.num_hidden_layers, 1, config.kv_lora_rank + config.qk_rope_head_dim,
                   dtype, latent_dim=config.kv_lora_rank)
        why = spec.latent_rotation_refusal()
        if why is not None:
            raise ValueError(why)
        return spec

    def latent_rotation_refusal(self) -> str | None:
        """Why this FP8 latent pool cannot store its rows (V's columns would cut a rotation block)."""
        if not (self.is_latent and self.is_fp8):
            return None
        block = hadamard_block(self.head_dim)
        if self.latent_dim % block:
            return (f"an FP8 KV cache rotates each {self.head_dim}-element latent row in blocks of {block}, which "
                    f"do not divide kv_lora_rank {self.latent_dim}; use --kv-cache-dtype auto")
        return None


DEFAULT_BUDGET_BYTES = 3 << 30


def default_budget_bytes(device: torch.device | str = "cpu") -> int:
    """The pool's budget when no flag sets one: 3 GiB, or half of the memory available now where
    that is less, so a small machine keeps room for the weights' work and its other processes."""
    return min(DEFAULT_BUDGET_BYTES, available_memory_bytes(device) // 2)


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Free bytes where the pool will live: the CUDA device's free memory for a CUDA device,
    the host's MemAvailable otherwise (never the GPU's for a CPU worker on a GPU machine)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def index_copy_rows(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src) for any pool dtype: torch has no float8 index_copy
    on CPU, so one-byte tensors copy as their bytes (src must already be dst's dtype)."""
    if dst.element_size() == 1 and dst.dtype != torch.uint8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(dim, index, src)


_FLOAT_ROWS = (torch.float32, torch.bfloat16, torch.float16)


def _fp8_writer():
    """The CPU paged decode extension (its write_kv), or None when it cannot be built."""
    from kernels import paged_decode_cpu
    return paged_decode_cpu.load()


def _cuda_writer():
    """kernels/triton/kv_write.write_kv_, or None without triton (then quantize_kv + index_copy_)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from kernels.triton.kv_write import write_kv_
    return write_kv_


def _heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, Hkv, D] with each row's heads back to back (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               pin: bool = False) -> torch.Tensor:
    """A pool's zeroed storage: on a device, or pinned host memory (locked at once), or plain host
    memory that costs RSS only once written (services/common/host_memory.py)."""
    if pin or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    return zeroed_host_tensor(shape, dtype)


class KVPool:
    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu", extra_pages: int = 0,
                 storage: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        """extra_pages: pages past spec.num_pages that the scheduler never hands out (the CUDA
        graphs' scratch page for padding rows: services/worker/cuda_graphs.py). storage: makes
        each of k and v, zeroed, from (shape, dtype), where the pool must live in special memory
        (a decode worker's shared-memory pool: services/worker/kv_transfer/registry.pool_storage);
        None: pool_zeros on `device`."""
        self.spec = spec
        shape = (spec.num_layers, spec.num_slots + extra_pages * spec.page_size, spec.num_kv_heads, spec.head_dim)
        storage = storage or functools.partial(pool_zeros, device=device)
        self.k = storage(shape, spec.dtype)  # [L, S, Hkv, D]
        v_shape = (*shape[:3], spec.v_head_dim)
        # [L, S, Hkv, D]; a latent pool's is zero-width [L, S, 1, 0] (V is read from K)
        self.v = storage(v_shape, spec.dtype) if spec.v_head_dim else torch.empty(v_shape, dtype=spec.dtype,
                                                                                 device=self.k.device)
        # An FP8 pool's C++ writer (write_kv), resolved once: write runs every layer of every step.
        self._fp8_writer = _fp8_writer() if spec.is_fp8 and self.k.device.type == "cpu" else None
        # On CUDA every pool's rows go through the Triton write (one launch for K and V, FP8 rotated in it).
        self._cuda_writer = _cuda_writer() if self.k.device.type == "cuda" else None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold KV bytes, for whatever copies, sends or stores pages: (k, v), or
        (k,) for a latent pool (its v is zero-width)."""
        return (self.k,) if self.spec.is_latent else (self.k, self.v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] int64; k, v [T, Hkv, D] in any float dtype (rounded to the pool's). An FP8
        pool's rows are rotated and rounded by the C++ kernel when it is built (the bytes
        quantize_kv stores, without its dozen small torch ops a layer), else by quantize_kv.
        A latent pool stores k alone (v is a view of it, or anything: not read)."""
        if self.spec.is_latent:
            index_copy_rows(self.k[layer], 0, slots, quantize_kv(k, self.spec.dtype))
            return
        if self._cuda_writer is not None and k.dtype in _FLOAT_ROWS and v.dtype == k.dtype:
            self._cuda_writer(self.k[layer], self.v[layer], k, v, slots)
            return
        native = self._fp8_writer
        if native is not None and k.dtype in _FLOAT_ROWS and v.dtype == k.dtype and _heads_contiguous(k) \
                and _heads_contiguous(v):
            native.write_kv(self.k[layer], self.v[layer], k, v, slots.to(torch.int64).contiguous())
            return
        index_copy_rows(self.k[layer], 0, slots, quantize_kv(k, self.spec.dtype))
        index_copy_rows(self.v[layer], 0, slots, quantize_kv(v, self.spec.dtype))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K and V rows of slots src [m] to slots dst [m] (int64), every layer, bytes as
        stored (an FP8 row's bytes stand alone: one scale per format, the rotation per row), e.g.
        a tree verify's accepted nodes to their positions (speculative/tree.compaction_slots).
        All sources are gathered before any destination is written, so src and dst may share slots
        (a destination that is another move's source); dst must not repeat a slot."""
        if src.shape != dst.shape:
            raise ValueError(f"move_slots needs as many sources as destinations: {tuple(src.shape)} vs "
                             f"{tuple(dst.shape)}")
        if src.numel() == 0:
            return
        src, dst = src.to(self.k.device, torch.int64), dst.to(self.k.device, torch.int64)
        for pool in self.tensors:  # [L, S, Hkv, D]
            rows = pool.view(torch.uint8) if pool.element_size() == 1 else pool  # no float8 index ops on CPU
            rows.index_copy_(1, dst, rows.index_select(1, src))  # the gather is the temp
