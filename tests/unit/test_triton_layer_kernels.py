"""The Triton element-wise layer kernels (kernels/triton/rms_norm.py, rope.py, activation.py) against
their torch references, and TritonLayerOps against TorchLayerOps on a tiny decoder layer, on CPU
under Triton's interpreter (enabled per module with the knob, as tests/unit/test_triton_bitmask.py
explains).

Tolerances: RoPE is exact under the interpreter (float32 products and sums one at a time, as
torch computes them; bfloat16 rounded to nearest even by the kernel's bits there). RMSNorm sums
in another order, so float32 differs by ulps and bfloat16/float16 by at most one ulp of the
result, and on at most 1% of elements at all (assert_mostly_exact); SiLU's exp is numpy's, not
torch's, likewise."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.triton import activation, rms_norm, rope
from services.worker.model.config import ModelConfig
from services.worker.model.layer_ops import TorchLayerOps, create_layer_ops
from services.worker.model.llama import DecoderLayer
from services.worker.model.rope import RotaryEmbedding
from services.worker.model.triton_layer_ops import TritonLayerOps
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
ONE_ULP = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
           torch.float16: dict(rtol=1e-3, atol=1e-6)}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def assert_mostly_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16/float16 of at least 100 elements: at most 1% differ at all (one rounding in float32,
    as the reference; a kernel that truncates or rounds twice differs on many more)."""
    if got.dtype != torch.float32 and got.numel() >= 100:
        assert (got != want).float().mean() <= 0.01


def rows(g, T: int, H: int, dtype, strided: bool, scale: float = 2.0) -> torch.Tensor:
    """[T, H] random times scale; strided: a column slice of a wider tensor (row stride H + 7)."""
    x = (torch.randn(T, H + 7 if strided else H, generator=g) * scale).to(dtype)  # slice after .to: it compacts
    out = x[:, 3:3 + H] if strided else x
    assert strided == (T > 1 and out.stride(0) != H)
    return out


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
@pytest.mark.parametrize("T, H, strided", [(9, 96, False), (5, 33, True), (3, 1000, True), (1, 1, False)],
                         ids=["96", "33-strided", "1000-strided", "1"])
def test_rms_norm_and_add_match_the_reference(dtype, T, H, strided):
    g = torch.Generator().manual_seed(H)
    x, residual = rows(g, T, H, dtype, strided), rows(g, T, H, dtype, strided)
    weight = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 1e-5), rms_norm.rms_norm_reference(x, weight, 1e-5),
                               **ONE_ULP[dtype])
    want, want_residual = rms_norm.add_rms_norm_reference(x, residual, weight, 1e-5)
    x_before, given = x.clone(), residual.clone()
    out, new_residual = rms_norm.add_rms_norm(x, given, weight, 1e-5)
    assert new_residual is given and torch.equal(given, want_residual)  # in place, rounded once like `residual + x`
    assert torch.equal(x, x_before)
    torch.testing.assert_close(out, want, **ONE_ULP[dtype])
    assert_mostly_exact(out, want)
    first, first_residual = rms_norm.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(first_residual, x) and first_residual.data_ptr() != x.data_ptr()
    torch.testing.assert_close(first, rms_norm.rms_norm_reference(x, weight, 1e-5), **ONE_ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_rms_norm_rounds_before_the_weight(dtype):
    """Not tautological: the kernel equals the reference on (nearly) every element, while skipping
    the rounding of the normalized value before the weight changes about a quarter of them, for
    weights far from 1."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(64, 128, generator=g).to(dtype), (torch.rand(128, generator=g) * 9).to(dtype)
    ref = rms_norm.rms_norm_reference(x, weight, 1e-6)
    assert_mostly_exact(rms_norm.rms_norm(x, weight, 1e-6), ref)
    unrounded = (weight.float() * F.rms_norm(x.float(), (128,), None, 1e-6)).to(dtype)
    assert (unrounded != ref).float().mean() > 0.1


def tables(scaling: dict | None, head_dim: int, positions: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, rope_theta=500000.0,
                         rope_scaling=scaling, max_position_embeddings=positions)
    r = RotaryEmbedding(config)
    return r.cos, r.sin


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (6, 2, 96), (8, 1, 80), (3, 1, 128)],
                         ids=["mha-64", "gqa3-96", "gqa8-80", "gqa3-128"])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rope_rotates_q_and_k_in_place_as_the_reference(dtype, heads, kv_heads, head_dim, scaling):
    g = torch.Generator().manual_seed(head_dim + heads)
    cos, sin = tables(scaling, head_dim)
    T, width = 7, (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(T, width + 5, generator=g) * 3).to(dtype)  # 5 columns past v: not touched
    positions = torch.tensor([0, 299, 5, 5, 64, 17, 200])
    want = rope.rope_qk_reference(qkv, positions, cos, sin, heads, kv_heads, head_dim)
    before = qkv.clone()
    out = rope.rope_qk_(qkv, positions, cos, sin, heads, kv_heads, head_dim)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(out, want)  # exact under the interpreter (module docstring)
    assert torch.equal(out[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])
    assert torch.equal(out[0], before[0])  # position 0: cos 1, sin 0
    assert not torch.equal(out[1, :head_dim], before[1, :head_dim])
    # and the contract is TorchLayerOps' (which rounds each product and sum to the dtype)
    torch.testing.assert_close(out, TorchLayerOps().rope_qk(before, positions, cos, sin, heads, kv_heads, head_dim),
                               **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)))


def test_rope_strided_rows_int32_positions_and_llama3_tables_differ():
    """qkv as a column slice (row stride wider than the row), positions int32; and the Llama-3
    table really differs from the default one at long wavelengths, so both table tests count."""
    g = torch.Generator().manual_seed(1)
    cos, sin = tables(LLAMA3, 64)
    wide = torch.randn(6, 2 + 4 * 64 + 3, generator=g).to(torch.bfloat16)
    qkv = wide[:, 2:2 + 4 * 64]
    positions = torch.tensor([3, 1, 250, 9, 0, 77], dtype=torch.int32)
    want = rope.rope_qk_reference(qkv, positions, cos, sin, 2, 1, 64)
    outside = wide[:, :2].clone(), wide[:, -3:].clone()
    rope.rope_qk_(qkv, positions, cos, sin, 2, 1, 64)
    assert torch.equal(qkv, want)
    assert torch.equal(wide[:, :2], outside[0]) and torch.equal(wide[:, -3:], outside[1])
    default_cos, _ = tables(None, 64)
    assert not torch.allclose(cos[250], default_cos[250], atol=1e-3)


def test_rope_reads_both_halves_of_the_tables():
    """Random tables whose halves differ (RotaryEmbedding's are equal, so they cannot tell):
    x1 takes cos[i], sin[i] and x2 cos[i + D/2], sin[i + D/2], as the reference and the C++ kernel."""
    g = torch.Generator().manual_seed(2)
    cos, sin = torch.randn(10, 32, generator=g), torch.randn(10, 32, generator=g)
    qkv = torch.randn(4, 5 * 32, generator=g)
    positions = torch.tensor([9, 0, 4, 4])
    want = rope.rope_qk_reference(qkv, positions, cos, sin, 2, 1, 32)
    assert torch.equal(rope.rope_qk_(qkv, positions, cos, sin, 2, 1, 32), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's exp overflow under the interpreter: intended
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
@pytest.mark.parametrize("T, inter, strided", [(7, 80, False), (3, 1500, True), (2, 1, False)],
                         ids=["80", "1500-strided", "1"])
def test_silu_mul_matches_the_reference(dtype, T, inter, strided):
    g = torch.Generator().manual_seed(inter)
    gate_up = rows(g, T, 2 * inter, dtype, strided, scale=8.0)
    if inter > 1:
        gate_up[0, :2] = torch.tensor([-100.0, 100.0], dtype=dtype)  # in place: the view stays strided  # exp(100) overflows: silu(-100) = -0
    out = activation.silu_mul(gate_up)
    assert out.shape == (T, inter) and out.is_contiguous()
    want = activation.silu_mul_reference(gate_up)
    torch.testing.assert_close(out, want, **ONE_ULP[dtype])
    assert_mostly_exact(out, want)
    torch.testing.assert_close(out, TorchLayerOps().silu_mul(gate_up),
                               **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)))


def tiny_layer(dtype) -> tuple[DecoderLayer, RotaryEmbedding, ModelConfig]:
    """One Llama decoder layer (GQA 4:2, head_dim 16, Llama-3 rope) with random weights."""
    config = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                         rope_scaling=LLAMA3, max_position_embeddings=128)
    torch.manual_seed(0)
    layer = DecoderLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) + (1 if p.dim() == 1 else 0))
    return layer.to(dtype), RotaryEmbedding(config), config


def causal_meta(positions: torch.Tensor, config: ModelConfig) -> SimpleNamespace:
    """A one-sequence ForwardMeta stand-in: causal attention over this step's q, k, v only."""
    def attention(layer_id, q, k, v):  # [T, H, D], [T, Hkv, D]
        group = config.num_attention_heads // config.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                             v.transpose(0, 1).float(), is_causal=True)
        return out.transpose(0, 1).to(q.dtype)
    return SimpleNamespace(positions=positions, attention=attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_layer_ops_run_a_decoder_layer_like_torch(dtype):
    """Two passes of a tiny layer (the first with residual None, the second with the residual it
    returned), TritonLayerOps against TorchLayerOps. bfloat16: TorchLayerOps rounds after every
    op, the Triton ops once, and the matmuls carry the differences on."""
    layer, rotary, config = tiny_layer(dtype)
    meta = causal_meta(torch.arange(5, 12), config)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    outs = {}
    for name, ops in (("torch", TorchLayerOps()), ("triton", TritonLayerOps())):
        with torch.no_grad():
            h, residual = layer(x, None, rotary, meta, ops)
            h, residual = layer(h, residual, rotary, meta, ops)
        outs[name] = h, residual
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(outs["triton"][0], outs["torch"][0], **tol)
    torch.testing.assert_close(outs["triton"][1], outs["torch"][1], **tol)
    assert outs["triton"][0].abs().mean() > 0.1  # the layer computed something


def test_create_layer_ops_picks_triton_on_cuda_only(monkeypatch):
    assert isinstance(create_layer_ops(True, torch.device("cuda")), TritonLayerOps)
    assert isinstance(create_layer_ops(False, torch.device("cuda")), TritonLayerOps)
    assert isinstance(create_layer_ops(False, torch.device("cpu")), TorchLayerOps)
    assert isinstance(create_layer_ops(True, torch.device("meta")), TorchLayerOps)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert isinstance(create_layer_ops(True, torch.device("cuda")), TorchLayerOps)


def _cos_sin():
    return tables(None, 8, positions=16)


@pytest.mark.parametrize("call, match", [
    (lambda: rms_norm.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-5),
     "float32/bfloat16/float16"),
    (lambda: rms_norm.rms_norm(torch.zeros(2, 3, 4), torch.ones(4), 1e-5), r"\[T, H\]"),
    (lambda: rms_norm.rms_norm(torch.zeros(4, 2).t(), torch.ones(4), 1e-5), "contiguous last dim"),
    (lambda: rms_norm.rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-5), r"weight must be contiguous \[H = 4\]"),
    (lambda: rms_norm.rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-5), "weight must be"),
    (lambda: rms_norm.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5), "residual"),
    (lambda: rms_norm.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4, device="meta"), torch.ones(4), 1e-5),
     "move it first"),
    (lambda: rope.rope_qk_(torch.zeros(2, 31), torch.zeros(2, dtype=torch.long), *_cos_sin(), 2, 1, 8),
     "cannot hold"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long), *_cos_sin(), 2, 1, 7),
     "even head_dim"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2), *_cos_sin(), 2, 1, 8), "int64/int32"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(3, dtype=torch.long), *_cos_sin(), 2, 1, 8),
     r"\[T = 2\]"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.tensor([0, 16]), *_cos_sin(), 2, 1, 8),
     r"positions must lie in \[0, 16\)"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.tensor([-1, 0]), *_cos_sin(), 2, 1, 8), "positions must lie"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long), _cos_sin()[0].double(),
                           _cos_sin()[1], 2, 1, 8), "cos must be"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long), torch.zeros(16, 4),
                           torch.zeros(16, 4), 2, 1, 8), r"\[P, D = 8\]"),
    (lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long), _cos_sin()[0], _cos_sin()[1][:8],
                           2, 1, 8), "must match"),
    (lambda: activation.silu_mul(torch.zeros(2, 5)), r"\[T, 2I\]"),
    (lambda: activation.silu_mul(torch.zeros(2, 4, dtype=torch.int32)), "float32/bfloat16/float16"),
    (lambda: activation.silu_mul(torch.zeros(4, 2).t()), "contiguous last dim"),
], ids=["norm-dtype", "norm-dims", "norm-stride", "weight-shape", "weight-dtype", "residual-shape", "device",
        "rope-width", "rope-odd-dim", "pos-dtype", "pos-count", "pos-high", "pos-negative", "table-dtype",
        "table-dim", "table-match", "silu-odd", "silu-dtype", "silu-stride"])
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        for call in (lambda: rms_norm.rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-5),
                     lambda: rope.rope_qk_(torch.zeros(2, 32), torch.zeros(2, dtype=torch.long), *_cos_sin(), 2, 1, 8),
                     lambda: activation.silu_mul(torch.zeros(2, 4))):
            with pytest.raises(ValueError, match="needs a CUDA device"):
                call()


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_compiles_for_the_gpu(dtype, tmp_path):
    """The interpreter runs the kernels as Python; the compiler is stricter. Each built for sm_90
    ahead of time (the residual-add mode of the norm, the bit rounding off as on a GPU)."""
    builds = [
        (rms_norm._kernel(False), {"x_ptr": dtype, "r_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "eps": "fp32"},
         dict(MODE=1, BLOCK=4096, ROUND_BF16=False)),
        (rope._kernel(False), {"qkv_ptr": dtype, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
         dict(BLOCK_HEADS=16, BLOCK_HALF=64, ROUND_BF16=False)),
        (activation._kernel(False), {"gu_ptr": dtype, "out_ptr": dtype}, dict(BLOCK=1024, ROUND_BF16=False)),
    ]
    for fn, types, consts in builds:
        compiled = compile_for_sm90(fn, types, consts, tmp_path)
        assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_compiled_kernels_on_cuda(dtype):
    """Each kernel on CUDA against its reference on the same inputs (float32: FMA contraction
    on the GPU, so ulps; bfloat16: one ulp)."""
    g = torch.Generator().manual_seed(13)
    x, residual = rows(g, 300, 4096, dtype, True), rows(g, 300, 4096, dtype, False)
    weight = (1 + 0.1 * torch.randn(4096, generator=g)).to(dtype)
    cos, sin = tables(LLAMA3, 128, positions=4096)
    qkv = (torch.randn(300, (32 + 16) * 128, generator=g) * 3).to(dtype)  # H 32, Hkv 8, D 128
    positions = torch.randint(0, 4096, (300,), generator=g)
    gate_up = rows(g, 300, 2 * 2000, dtype, True, scale=8.0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else ONE_ULP[dtype]
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        cuda = lambda t: t.cuda()  # noqa: E731
        torch.testing.assert_close(rms_norm.rms_norm(cuda(x), cuda(weight), 1e-5).cpu(),
                                   rms_norm.rms_norm_reference(x, weight, 1e-5), **tol)
        out, res = rms_norm.add_rms_norm(cuda(x), cuda(residual), cuda(weight), 1e-5)
        want, want_res = rms_norm.add_rms_norm_reference(x, residual, weight, 1e-5)
        assert torch.equal(res.cpu(), want_res)
        torch.testing.assert_close(out.cpu(), want, **tol)
        got = rope.rope_qk_(cuda(qkv), cuda(positions), cuda(cos), cuda(sin), 32, 8, 128).cpu()
        torch.testing.assert_close(got, rope.rope_qk_reference(qkv, positions, cos, sin, 32, 8, 128), **tol)
        torch.testing.assert_close(activation.silu_mul(cuda(gate_up)).cpu(), activation.silu_mul_reference(gate_up),
                                   **tol)
