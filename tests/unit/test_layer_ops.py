"""The fused C++ layer ops (kernels/cpu/fused_ops.cpp) against the torch reference ops."""
from __future__ import annotations

import pytest

from tests.kernel_builds import built
import torch

from kernels import fused_cpu
from services.worker.model.layer_ops import FusedCpuLayerOps, TorchLayerOps, create_layer_ops

module = built(fused_cpu)
REF = TorchLayerOps()
# float32: a few ulps (summation order, fused multiply-adds); bfloat16: the fused ops
# round once where the reference rounds after every op, so allow about one bf16 ulp.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture
def fused() -> FusedCpuLayerOps:
    return FusedCpuLayerOps(module)


def _tables(n_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_norms_match_reference(fused, dtype, rows):
    torch.manual_seed(rows)
    x, res = torch.randn(rows, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), **TOL[dtype])
    out, new_res = fused.add_rms_norm(x, res.clone(), w, 1e-5)
    ref_out, ref_res = REF.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the residual add rounds exactly like `residual + x`
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    first, first_res = fused.add_rms_norm(x, None, w, 1e-5)
    assert torch.equal(first_res, x)
    torch.testing.assert_close(first, REF.rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_only_in_place(fused, dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, rows = 6, 2, 32, 9
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    pos = torch.tensor([0, 5, 5, 17, 3, 99, 1, 0, 42])
    cos, sin = _tables(128, dim)
    ref = REF.rope_qk(qkv, pos, cos, sin, heads, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    out = fused.rope_qk(qkv, pos, cos, sin, heads, kv_heads, dim)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(out[:, (heads + kv_heads) * dim:], v_before)  # v untouched
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(out[0, :dim], ref[0, :dim]) or dtype != torch.float32  # position 0: identity


def test_rope_rejects_positions_outside_the_table(fused):
    cos, sin = _tables(8, 16)
    with pytest.raises(RuntimeError, match="position out of the rope table"):
        fused.rope_qk(torch.randn(2, 64), torch.tensor([1, 8]), cos, sin, 2, 1, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(fused, dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(33, 2 * 80, dtype=dtype) * 4
    torch.testing.assert_close(fused.silu_mul(gate_up), REF.silu_mul(gate_up), **TOL[dtype])


def test_create_layer_ops_picks_fused_on_cpu_only_when_asked():
    assert isinstance(create_layer_ops(True, torch.device("cpu")), FusedCpuLayerOps)
    assert isinstance(create_layer_ops(False, torch.device("cpu")), TorchLayerOps)
