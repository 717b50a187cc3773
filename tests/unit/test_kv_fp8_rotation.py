"""The rotation FP8 KV rows are stored under (kernels/kv_fp8.py, kernels/cpu/fp8.h): it is the
orthonormal Walsh-Hadamard matrix per power-of-two block, its own inverse, and it is why
e4m3 KV keeps scores accurate when the query and the keys share outlier channels."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.kv_fp8 import FP8_KV_SCALES, dequantize_kv, hadamard_block, hadamard_rotate, quantize_kv, widen_kv


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("d, block", [(64, 64), (128, 128), (96, 32), (48, 16), (8, 8), (7, 1)])
def test_rotation_is_the_blockwise_hadamard_matrix_and_its_own_inverse(d, block):
    assert hadamard_block(d) == block
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    rotated = hadamard_rotate(x)
    h = torch.block_diag(*[_sylvester(block)] * (d // block))
    torch.testing.assert_close(rotated.double(), x.double() @ h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_rotate(rotated), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))  # orthonormal
    assert torch.equal(hadamard_rotate(x[2:3]), rotated[2:3])  # a row's result is the same alone or in a batch


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dequantize_undoes_the_rotation_and_widen_keeps_it(dtype):
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(1)) * 3
    stored = quantize_kv(x, dtype)
    torch.testing.assert_close(widen_kv(stored, torch.float32), stored.float() * FP8_KV_SCALES[dtype])
    back = dequantize_kv(stored, torch.float32)
    torch.testing.assert_close(back, hadamard_rotate(widen_kv(stored, torch.float32)), atol=1e-5, rtol=1e-5)
    rel = float((back - x).norm() / x.norm())
    assert rel < {torch.float8_e4m3fn: 0.04, torch.float8_e5m2: 0.08}[dtype]


def test_rotation_keeps_scores_accurate_when_query_and_keys_share_an_outlier_channel():
    """The failure it fixes: K with one large channel that q also weighs heavily (as this
    model's K has). Rounded in place, every key's error sits on that channel and q amplifies
    it in every score; rotated, the error spreads over all 64 channels and mostly cancels
    against q. The scores' error is several times smaller."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4096, 64, generator=g)
    k[:, 5] += 20.0
    q = torch.randn(64, generator=g)
    q[5] = 8.0
    scale = FP8_KV_SCALES[torch.float8_e4m3fn]
    in_place = (k / scale).to(torch.float8_e4m3fn).float() * scale  # the old, unrotated rounding
    rotated = dequantize_kv(quantize_kv(k, torch.float8_e4m3fn), torch.float32)
    err_in_place = float(((in_place - k) @ q).abs().mean())
    err_rotated = float(((rotated - k) @ q).abs().mean())
    assert err_rotated < err_in_place / 3
