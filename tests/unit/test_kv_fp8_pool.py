"""The FP8 KV pool's bookkeeping (--kv-cache-dtype): capacity at a byte budget, the write
rounding, the host tier and the kvstore codec moving FP8 pages byte for byte, and page
identity that never lets a page of one KV dtype be read as another."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import hadamard_rotate
from services.common.page_hash import KeyNamespace, PageHasher
from services.kvstore.page_codec import PageSpec, decode_batch, encode
from services.step.contract import DEVICE, HOST, STORE, KVCopy
from services.worker.config import WorkerConfig
from services.worker.host_pool import HostKVPool, KVTransfer
from services.worker.kv_pool import KVPool, KVPoolSpec, quantize_kv
from services.worker.model.config import ModelConfig

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _smollm2_shape() -> ModelConfig:
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("budget", [64 << 20, 3 << 30, 1_000_003])
def test_fp8_pool_holds_at_least_1_9x_the_tokens_of_bfloat16(dtype, budget):
    mc = _smollm2_shape()
    bf16 = KVPoolSpec.from_budget(mc, 16, torch.bfloat16, budget, None)
    fp8 = KVPoolSpec.from_budget(mc, 16, dtype, budget, None)
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert fp8.capacity_tokens >= 1.9 * bf16.capacity_tokens
    assert fp8.total_bytes <= budget
    pool = KVPool(KVPoolSpec(4, 16, 2, 3, 64, dtype))
    assert pool.k.dtype == dtype and pool.k.element_size() == 1  # really one byte an element


def test_the_config_names_the_kv_dtype():
    assert WorkerConfig(dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert WorkerConfig(dtype="float32", kv_cache_dtype="fp8_e4m3").kv_torch_dtype == torch.float8_e4m3fn
    assert WorkerConfig(kv_cache_dtype="fp8_e5m2").kv_torch_dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype must be auto or one of"):
        WorkerConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", FP8)
def test_write_stores_torchs_rounding_of_the_scaled_rows(dtype):
    pool = KVPool(KVPoolSpec(4, 4, 2, 2, 8, dtype))
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16) * 10
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 15])
    pool.write(1, slots, k, v)
    scale = pool.spec.kv_scale  # rows stored rotated: fp8(H x / scale), kernels/kv_fp8.py
    assert torch.equal(pool.k[1][slots].view(torch.uint8),
                       (hadamard_rotate(k.float()) / scale).to(dtype).view(torch.uint8))
    assert torch.equal(pool.v[1][slots].view(torch.uint8), (hadamard_rotate(v) / scale).to(dtype).view(torch.uint8))
    assert not pool.k[0].view(torch.uint8).any()  # other layers untouched


def _filled_pool(dtype: torch.dtype, pages: int, seed: int = 0) -> KVPool:
    pool = KVPool(KVPoolSpec(pages, 4, 3, 2, 16, dtype))
    g = torch.Generator().manual_seed(seed)
    for layer in range(3):
        slots = torch.arange(pool.spec.num_slots)
        pool.write(layer, slots, torch.randn(len(slots), 2, 16, generator=g) * 5,
                   torch.randn(len(slots), 2, 16, generator=g))
    return pool


def _page_bytes(pool, pages: list[int]) -> torch.Tensor:
    slots = torch.tensor([p * pool.spec.page_size + i for p in pages for i in range(pool.spec.page_size)])
    return torch.stack([pool.k[:, slots].view(torch.uint8), pool.v[:, slots].view(torch.uint8)])


class _DictStore:
    """BlockingKVStore's surface over a dict of encoded payloads (the codec runs for real)."""

    def __init__(self, spec: PageSpec):
        self.spec, self.data = spec, {}

    def put_nowait(self, keys, pages: torch.Tensor) -> None:
        for key, page in zip(keys, pages):
            self.data[key] = encode(page, self.spec)

    def get_prefix(self, keys) -> torch.Tensor:
        found = []
        for key in keys:
            if key not in self.data:
                break
            found.append(self.data[key])
        pages, ok = decode_batch(found, self.spec)
        assert all(ok)
        return pages


@pytest.mark.parametrize("dtype", FP8)
def test_host_tier_and_store_round_trip_fp8_pages_byte_for_byte(dtype):
    device = _filled_pool(dtype, 6)
    host = HostKVPool(KVPoolSpec(5, 4, 3, 2, 16, dtype))
    spec = PageSpec.from_pool(device.spec)
    store = _DictStore(spec)
    xfer = KVTransfer(device, host, store)
    original = _page_bytes(device, [1, 4])
    stats = xfer.run([KVCopy(DEVICE, HOST, [1, 4], [3, 0])])
    assert stats[0].pages == 2 and stats[0].bytes == 2 * 4 * device.spec.bytes_per_token  # half of bf16's
    assert torch.equal(_page_bytes(host, [3, 0]), original)
    keys = [b"k1" * 16, b"k4" * 16]
    xfer.run([KVCopy(HOST, STORE, [3, 0], [], keys)])
    assert all(len(p) == spec.nbytes == 3 * 2 * 4 * 2 * 16 for p in store.data.values())  # 1 byte an element
    fresh = KVPool(device.spec)
    back = KVTransfer(fresh, None, store)
    assert back.run([KVCopy(STORE, DEVICE, [], [2, 5], keys)])[0].pages == 2
    assert torch.equal(_page_bytes(fresh, [2, 5]), original)
    xfer.run([KVCopy(HOST, DEVICE, [3], [0])])  # host -> device too
    assert torch.equal(_page_bytes(device, [0]), original[:, :, :4])  # page 1 (of host page 3), slots 0..3


def test_a_page_of_another_kv_dtype_cannot_enter_a_pool():
    fp8 = KVPool(KVPoolSpec(2, 4, 3, 2, 16, torch.float8_e4m3fn))
    xfer = KVTransfer(fp8, None)
    bf16_pages = torch.zeros((1, 3, 2, 4, 2, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot enter"):
        xfer.scatter(DEVICE, [0], bf16_pages)
    spec8 = PageSpec.from_pool(fp8.spec)
    page16 = PageSpec(3, 4, 2, 16, torch.bfloat16)
    # a bf16 payload is twice the length: it decodes as a miss, never as fp8 bytes
    _, ok = decode_batch([encode(torch.zeros(page16.shape, dtype=torch.bfloat16), page16)], spec8)
    assert ok == [False]


def test_page_identity_differs_by_kv_dtype():
    layouts = {dtype: PageSpec(30, 16, 3, 64, dtype).layout
               for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)}
    assert len(set(layouts.values())) == 4
    assert layouts[torch.float8_e4m3fn] == "float8_e4m3fn*0.25+hadamard:L30:KV2:H3:D64"
    assert layouts[torch.float8_e5m2] == "float8_e5m2*1+hadamard:L30:KV2:H3:D64"
    tokens = list(range(64))
    keys = {dtype: PageHasher(KeyNamespace("m:1", "0", "", 16, layout)).keys(tokens)
            for dtype, layout in layouts.items()}
    for a in keys:
        for b in keys:
            if a != b:
                assert not set(keys[a]) & set(keys[b])  # no page key shared across KV dtypes


def test_quantize_kv_keeps_model_dtypes_as_plain_casts():
    x = torch.randn(4, 2, 8)
    assert torch.equal(quantize_kv(x, torch.bfloat16), x.to(torch.bfloat16))
    assert quantize_kv(x, torch.float32) is not None and torch.equal(quantize_kv(x, torch.float32), x)


def test_worker_info_and_metrics_name_the_kv_dtype_and_capacity():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from services.worker.info import worker_info
    from services.worker.service import WorkerService
    config = WorkerConfig(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    spec = KVPoolSpec(364, 16, 30, 3, 64, config.kv_torch_dtype)
    runner = SimpleNamespace(model_config=_smollm2_shape(), kv_spec=spec, config=config, weights_version=0,
                             max_draft_tokens=0, verify_rows=0, max_loras=0, loras=None)
    info = worker_info(runner, (2,))
    assert info.kv_dtype == "float8_e4m3fn" and info.dtype == "bfloat16"
    service = WorkerService(config)
    service.info, service._model = info, "SmolLM2"
    text = generate_latest(service.registry).decode()
    assert 'radixmesh:kv_capacity_tokens{model_name="SmolLM2"} 5824.0' in text
    assert 'radixmesh:kv_cache_info{kv_dtype="float8_e4m3fn",model_name="SmolLM2"} 1.0' in text
