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


def test_rejects_bad_shapes(kernel):
    q = torch.randn(2, 4, 64)
    k = torch.randn(10, 3, 64)  # 4 heads are not a multiple of 3 KV heads
    with pytest.raises(RuntimeError):
        paged_decode_cpu.paged_decode_attention(q, k, k, torch.zeros(2, 5, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="kv_lens"):
        paged_decode_cpu.paged_decode_attention(q, torch.randn(10, 2, 64), torch.randn(10, 2, 64),
                                                torch.zeros(2, 5, dtype=torch.long),
                                                torch.tensor([0, 9]), 0.1)
