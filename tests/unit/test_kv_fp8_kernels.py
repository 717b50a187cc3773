"""FP8 KV (--kv-cache-dtype) in the attention kernels: the C++ paged decode kernel's widening
of every byte of both formats, its attention against the torch reference that dequantizes then
attends (GQA, page sizes 1 and 16, head dims 64/128/48, float32 and bfloat16 queries), and the
torch backend's extend + decode path on an FP8 pool against plain float32 causal attention.
Tolerances: float32 queries 2e-5 (float32 math, summation order), bfloat16 1 bf16 ulp-ish (2e-2)."""
from __future__ import annotations

import math

import pytest

from tests.kernel_builds import built
import torch

from kernels import paged_decode_cpu
from kernels.kv_fp8 import FP8_KV_SCALES, dequantize_kv, hadamard_rotate, quantize_kv
from services.worker.attention.batch_layout import BatchLayout
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.kv_pool import KVPool, KVPoolSpec

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def kernel():
    return built(paged_decode_cpu)


@pytest.mark.parametrize("dtype", FP8)
def test_every_byte_widens_as_torch_does(kernel, dtype):
    """One request per byte value, attending over a single row that holds the byte in its
    first element and zeros elsewhere: softmax of one score is exactly 1, and the rotation
    back (kernels/kv_fp8.py) spreads x * scale as x * scale / 8 over all 64 outputs, exactly
    (a power of two). So each output equals torch's widening, infinities, NaNs and
    subnormals included."""
    v = torch.zeros(256, 1, 64, dtype=torch.uint8)  # [S=256, Hkv=1, D=64]
    v[:, 0, 0] = torch.arange(256, dtype=torch.uint8)
    v = v.view(dtype)
    k = torch.zeros_like(v)
    q = torch.randn(256, 1, 64)
    slots = torch.arange(256, dtype=torch.int64)[:, None]  # [B=256, L=1]
    out = paged_decode_cpu.paged_decode_attention(q, k, v, slots, torch.ones(256, dtype=torch.int64), 0.125)
    widened = v[:, :, :1].float() * FP8_KV_SCALES[dtype] / 8  # [256, 1, 1]
    torch.testing.assert_close(out, widened.expand(-1, -1, 64), rtol=0, atol=0, equal_nan=True)


def _paged_case(page_size: int, lens: list[int], hkv: int, d: int, seed: int):
    """Random pages per request (page tables drawn from a shuffled pool) → slots [B, L]."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    order = torch.randperm(num_pages, generator=g)
    L, rows, used = max(lens), [], 0
    for n in lens:
        pages = order[used:used + -(-n // page_size)]
        used += len(pages)
        pos = torch.arange(L).clamp(max=n - 1)
        rows.append(pages[pos // page_size] * page_size + pos % page_size)
    k = torch.randn(num_pages * page_size, hkv, d, generator=g) * 4
    v = torch.randn(num_pages * page_size, hkv, d, generator=g)
    return k, v, torch.stack(rows), torch.tensor(lens, dtype=torch.int64), g


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 48)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_equals_the_dequantizing_reference(kernel, dtype, page_size, h, hkv, d, qdtype):
    k, v, slots, lens, g = _paged_case(page_size, [37, 1, 16, 70], hkv, d, seed=page_size * 100 + d)
    k8, v8 = quantize_kv(k, dtype), quantize_kv(v, dtype)
    q = torch.randn(4, h, d, generator=g).to(qdtype)
    out = paged_decode_cpu.paged_decode_attention(q, k8, v8, slots, lens, d ** -0.5)
    ref = paged_decode_cpu.reference(q, k8, v8, slots, lens, d ** -0.5)
    assert out.dtype == qdtype
    tol = 2e-5 if qdtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # and FP8 really is an approximation of the unquantized KV, not something else
    exact = paged_decode_cpu.reference(q.float(), k, v, slots, lens, d ** -0.5)
    assert (out.float() - exact).abs().mean() < 0.1


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rows", ["quantized", "float32", "bfloat16"])
def test_decode_kernel_writes_the_steps_rows_first(kernel, dtype, rows):
    """The step's rows given already rounded (copied) or in the model's dtype (the kernel
    rotates and rounds them): either way the pool gets quantize_kv's bytes."""
    k, v, slots, lens, g = _paged_case(16, [5, 9], 2, 64, seed=7)
    k8, v8 = quantize_kv(k, dtype), quantize_kv(v, dtype)
    new_slots = torch.stack([slots[b, lens[b] - 1] for b in range(2)])
    k_new, v_new = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    if rows != "quantized":
        k_new, v_new = k_new.to(getattr(torch, rows)), v_new.to(getattr(torch, rows))
    q = torch.randn(2, 6, 64, generator=g)
    expect_k, expect_v = k8.clone(), v8.clone()
    expect_k.view(torch.uint8)[new_slots] = quantize_kv(k_new, dtype).view(torch.uint8)
    expect_v.view(torch.uint8)[new_slots] = quantize_kv(v_new, dtype).view(torch.uint8)
    given = (quantize_kv(k_new, dtype), quantize_kv(v_new, dtype)) if rows == "quantized" else (k_new, v_new)
    out = paged_decode_cpu.paged_decode_attention(q, k8, v8, slots, lens, 0.125, *given, new_slots)
    assert torch.equal(k8.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), expect_v.view(torch.uint8))
    torch.testing.assert_close(out, paged_decode_cpu.reference(q, expect_k, expect_v, slots, lens, 0.125),
                               atol=2e-5, rtol=2e-5)


def _causal_reference(q: torch.Tensor, pool: KVPool, layer: int, layout: BatchLayout, scale: float) -> torch.Tensor:
    """Per item: its pool K/V (widened, scaled) over positions < kv_len, causal, float32 math."""
    out = torch.empty(q.shape, dtype=torch.float32)
    first = 0
    for i in range(len(layout.q_lens)):
        n, start, kv = int(layout.q_lens[i]), int(layout.start_pos[i]), int(layout.kv_lens[i])
        pos = torch.arange(kv)
        slots = layout.page_rows[i, pos // layout.page_size] * layout.page_size + pos % layout.page_size
        kk = dequantize_kv(pool.k[layer][slots], torch.float32).transpose(0, 1)  # [Hkv, kv, D]
        vv = dequantize_kv(pool.v[layer][slots], torch.float32).transpose(0, 1)
        qq = q[first:first + n].float().transpose(0, 1)  # [H, n, D]
        mask = torch.arange(kv)[None, :] <= (start + torch.arange(n))[:, None]  # [n, kv]
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:first + n] = o.transpose(0, 1)
        first += n
    return out


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("native", [False, True])
def test_torch_backend_extend_and_decode_on_an_fp8_pool(kernel, dtype, page_size, native):
    """A mixed step (two prefill chunks, one continuing earlier KV, and a decode) then a pure
    decode step, through TorchAttentionBackend (native: the C++ kernel takes the decode step):
    outputs equal float32 attention over the pool's widened contents, and the pool holds the
    step's K/V exactly as quantize_kv rounds them."""
    H, Hkv, D, L = 6, 2, 64, 2
    spec = KVPoolSpec(num_pages=64 // page_size * 4, page_size=page_size, num_layers=L, num_kv_heads=Hkv,
                      head_dim=D, dtype=dtype)
    pool = KVPool(spec)
    g = torch.Generator().manual_seed(page_size)
    per_item = 40 // page_size + 2  # pages per request
    page_rows = torch.randperm(spec.num_pages, generator=g)[:3 * per_item].view(3, per_item)
    backend = TorchAttentionBackend(0.125, native_decode=native)
    history = {1: 11}  # item 1 has 11 tokens of KV from before (written here first)
    pre = BatchLayout.build([11], [0], page_rows[1:2], page_size)
    pool.write(0, pre.out_slots, torch.randn(11, Hkv, D, generator=g) * 4, torch.randn(11, Hkv, D, generator=g))
    pool.write(0, BatchLayout.build([20], [0], page_rows[2:3], page_size).out_slots,
               torch.randn(20, Hkv, D, generator=g) * 4, torch.randn(20, Hkv, D, generator=g))
    for q_lens, starts in (([9, 5, 1], [0, history[1], 20]), ([1, 1, 1], [9, 16, 21])):
        layout = BatchLayout.build(q_lens, starts, page_rows, page_size)
        T = sum(q_lens)
        q = torch.randn(T, H, D, generator=g)
        k, v = torch.randn(T, Hkv, D, generator=g) * 4, torch.randn(T, Hkv, D, generator=g)
        backend.prepare(layout, pool)
        out = backend.forward(0, q, k, v)
        assert torch.equal(pool.k[0][layout.out_slots].view(torch.uint8), quantize_kv(k, dtype).view(torch.uint8))
        assert torch.equal(pool.v[0][layout.out_slots].view(torch.uint8), quantize_kv(v, dtype).view(torch.uint8))
        torch.testing.assert_close(out, _causal_reference(q, pool, 0, layout, 0.125), atol=2e-5, rtol=2e-5)


def test_write_rounding_is_torchs_and_saturates_e4m3():
    x = torch.tensor([0.0, 1e-9, -3e-3, 0.3, 111.9, 200.0, -1e6])
    q = quantize_kv(x, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), (x * 4).to(torch.float8_e4m3fn).view(torch.uint8))
    back = dequantize_kv(q, torch.float32)
    assert back[5] == back[6] * -1 == 112.0  # 448 * 1/4: saturated, not NaN
    assert math.isclose(back[3], 0.3, rel_tol=1 / 16)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 48])
def test_native_pool_write_stores_quantize_kvs_bytes(kernel, dtype, rows, d):
    """KVPool.write on an FP8 pool goes through the C++ write_kv: byte for byte the torch
    reference (kernels/kv_fp8.quantize_kv), over values from tiny to saturating, strided rows."""
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(300, 5, d, generator=g) * torch.logspace(-4, 3, 300)[:, None, None]  # [T, 2 + Hkv*.., D]
    k, v = qkv[:, :2].to(rows), qkv[:, 2:4].to(rows)  # [T, Hkv=2, D], row stride 5*D
    pool = KVPool(KVPoolSpec(40, 16, 1, 2, d, dtype))
    slots = torch.randperm(640, generator=g)[:300]
    pool.write(0, slots, k, v)
    assert torch.equal(pool.k[0][slots].view(torch.uint8), quantize_kv(k, dtype).view(torch.uint8))
    assert torch.equal(pool.v[0][slots].view(torch.uint8), quantize_kv(v, dtype).view(torch.uint8))


@pytest.mark.parametrize("d", [64, 128, 48])
def test_kernel_rotation_of_rows_is_kv_fp8s(kernel, d):
    """hadamard_rows (the torch path's query/output rotation on the cpu backend) runs the
    butterflies of kv_fp8.hadamard_rotate: the same floats, in place."""
    x = torch.randn(37, 9, d, generator=torch.Generator().manual_seed(d)) * 30
    expected = hadamard_rotate(x)
    assert kernel.hadamard_rows(x) is x
    assert torch.equal(x, expected)
