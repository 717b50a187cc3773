"""The C++ paged decode kernel against its torch reference on random inputs."""
from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_cpu


@pytest.fixture(scope="module")
def kernel():
    module = paged_decode_cpu.load()
    assert module is not None, "the CPU kernel must build where a compiler is present (CI has one)"
    return module


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 80)])
@pytest.mark.parametrize("B", [3, 33])  # few requests: a task per KV head; many: a task per request
def test_matches_reference(kernel, dtype, atol, heads, kv_heads, head_dim, B):
    g = torch.Generator().manual_seed(heads * head_dim + B)
    S, L = 500, 61
    q = torch.randn(B, heads, head_dim, generator=g)
    k = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randint(0, S, (B, L), generator=g)  # scattered pages
    lens = torch.randint(1, L + 1, (B,), generator=g)
    lens[0], lens[1] = 1, L
    out = paged_decode_cpu.paged_decode_attention(q, k, v, slots, lens, head_dim ** -0.5)
    ref = paged_decode_cpu.reference(q, k, v, slots, lens, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 64), (2, 2, 64), (16, 4, 128), (8, 1, 128)])
@pytest.mark.parametrize("L", [1, 16, 17, 200])  # around the 16-row blocks of the AVX512-BF16 kernel
def test_bf16_queries_strided_rows_and_kv_write(kernel, heads, kv_heads, head_dim, L):
    """The serving call: bfloat16 q and KV (the AVX512-BF16 kernel where compiled in), q/k/v
    as views of one fused qkv row, this step's K/V written by the kernel before it attends."""
    g = torch.Generator().manual_seed(heads * L + head_dim)
    B, S = 5, 400
    qkv = torch.randn(B, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = qkv[:, :q_end].view(B, heads, head_dim)  # strided rows: not contiguous
    k_new, v_new = (qkv[:, a:b].view(B, kv_heads, head_dim) for a, b in ((q_end, k_end), (k_end, None)))
    k = torch.randn(S, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(S, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    new_slots = torch.randperm(S, generator=g)[:B]
    slots = torch.randint(0, S, (B, L), generator=g)
    lens = torch.randint(1, L + 1, (B,), generator=g)
    lens[0] = L
    slots[torch.arange(B), lens - 1] = new_slots  # each request attends to the row it writes
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[new_slots], v_ref[new_slots] = k_new, v_new
    out = paged_decode_cpu.paged_decode_attention(q, k, v, slots, lens, head_dim ** -0.5, k_new, v_new, new_slots)
    assert out.dtype == torch.bfloat16 and out.shape == (B, heads, head_dim)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    ref = paged_decode_cpu.reference(q.float(), k_ref, v_ref, slots, lens, head_dim ** -0.5)
    # bfloat16 output: one rounding of a float32 result (~2^-8 relative)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_rejects_bad_shapes(kernel):
    q = torch.randn(2, 4, 64)
    k = torch.randn(10, 3, 64)  # 4 heads are not a multiple of 3 KV heads
    with pytest.raises(RuntimeError, match="shape mismatch"):
        paged_decode_cpu.paged_decode_attention(q, k, k, torch.zeros(2, 5, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="kv_lens"):
        paged_decode_cpu.paged_decode_attention(q, torch.randn(10, 2, 64), torch.randn(10, 2, 64),
                                                torch.zeros(2, 5, dtype=torch.long),
                                                torch.tensor([0, 9]), 0.1)
    k = torch.randn(10, 2, 64)
    with pytest.raises(RuntimeError, match="new slot"):
        paged_decode_cpu.paged_decode_attention(q, k, k.clone(), torch.zeros(2, 5, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 0.1, torch.randn(2, 2, 64),
                                                torch.randn(2, 2, 64), torch.tensor([3, 10]))
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_cpu.paged_decode_attention(q, k, k.clone(), torch.zeros(2, 5, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 0.1,
                                                torch.randn(2, 2, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16(),
                                                torch.tensor([3, 4]))


def test_avx512_bf16_kernel_is_compiled_in_where_the_cpu_has_it(kernel):
    """-march=native must reach the build: without it the bfloat16 serving path silently
    falls back to the portable loops (about 1.5-2x slower). Under RADIXMESH_CPU_ISA=avx2 the
    portable loops are what must be built."""
    from kernels import cpu_isa
    assert kernel.has_avx512_bf16_path() == cpu_isa.has("avx512f", "avx512_bf16")
