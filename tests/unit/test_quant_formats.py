"""Every quantized weight format the CPU kernels compute on (kernels/quant_formats.py,
kernels/quant_gemv.py): the split of a GGUF tensor's blocks dequantizes bit for bit as
gguf's own dequantizer does (random blocks, gguf-quantized weights, the default model's
tensors), the fused few-row dot products stay within a stated float32 tolerance of the
float64 matmul with those weights, the many-row tile path within the tolerance of its
tile dtype, and int8 per-channel follows its stated rounding rule.

Tolerance of the fused path (float32 math, any summation order): per output,
|y - y_ref| <= 1e-5 * sum_k |x_k| |w_k| + 1e-6, where y_ref is the float64 matmul.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.common.quant_blocks import random_blocks, weight
from kernels import cpu_isa, quant_gemv
from kernels.quant_formats import FORMATS, GGUF_FORMATS
from kernels.quant_gemv import QuantWeight

SIMPLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf can quantize these itself
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
ALL = (*GGUF_FORMATS, "int8")


@pytest.fixture(scope="module")
def kernel():
    module = quant_gemv.load()
    assert module is not None, "the CPU kernel must build where a compiler is present (CI has one)"
    return module


def gguf_dequantize(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))


def assert_fused_tolerance(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The module docstring's bound, against float64."""
    ref = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max()):.2f}x the bound"


@pytest.mark.parametrize("qtype", GGUF_FORMATS)
def test_random_blocks_dequantize_bit_exact_with_gguf(qtype):
    K = 512  # two k-quant super-blocks, sixteen 32-blocks
    blocks = random_blocks(qtype, 13, K, seed=len(qtype))
    qw = QuantWeight.from_blocks(torch.from_numpy(blocks), qtype)
    assert qw.shape == (13, K) and qw.qtype == qtype
    assert torch.equal(qw.dequantize(), gguf_dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", SIMPLE)
def test_gguf_quantized_weights_dequantize_bit_exact(qtype):
    w = np.random.default_rng(1).standard_normal((40, 96), dtype=np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    assert torch.equal(QuantWeight.from_blocks(torch.from_numpy(blocks), qtype).dequantize(),
                       gguf_dequantize(blocks, qtype))


@pytest.mark.slow
def test_the_default_models_tensors_dequantize_bit_exact():
    """The real file's Q4_1 projections and its Q8_0 embedding (read straight from the file)."""
    from services.common.model_path import default_model_path
    try:
        reader = gguf.GGUFReader(default_model_path())
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in FORMATS and len(t.data.shape) == 2 and (name not in seen or t.name == "token_embd.weight"):
            blocks = np.array(t.data[:512])  # rows as stored
            qw = QuantWeight.from_blocks(torch.from_numpy(blocks), name)
            assert torch.equal(qw.dequantize(), gguf_dequantize(blocks, name)), t.name
            seen.add(name)
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("qtype", ALL)
def test_resident_bytes_are_the_packed_values_and_float32_scales(qtype):
    f = FORMATS[qtype]
    N, K = 24, 512
    qw = weight(qtype, N, K)
    scales = N * K // f.scale_group * 4 + (N * K // 32 * 4 if f.has_m else 0)
    assert qw.nbytes == N * K * f.bits // 8 + scales
    assert qw.nbytes < N * K * 2 * (0.6 if f.bits <= 5 else 0.75)  # well under bfloat16's


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
def test_fused_rows_within_tolerance(kernel, qtype, T):
    K = 512
    qw = weight(qtype, 67, K, seed=T)  # 67: off every row grouping
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    bias = torch.randn(67)
    out = quant_gemv.quant_linear(x, qw, None, kernel)
    assert out.shape == (T, 67) and out.dtype == torch.float32
    assert_fused_tolerance(out, x, qw.dequantize())
    with_bias = quant_gemv.quant_linear(x, qw, bias, kernel)
    torch.testing.assert_close(with_bias, out + bias, rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ALL)
def test_a_fused_rows_result_does_not_depend_on_the_rows_beside_it(kernel, qtype):
    qw = weight(qtype, 37, 256, seed=4)
    x = torch.randn(quant_gemv.FUSED_MAX_ROWS, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([quant_gemv.quant_linear(x[i:i + 1], qw, None, kernel) for i in range(x.shape[0])])
    for T in range(2, x.shape[0] + 1):
        assert torch.equal(quant_gemv.quant_linear(x[:T], qw, None, kernel), alone[:T]), T


@pytest.mark.parametrize("qtype", ALL)
@pytest.mark.parametrize("T", [9, 64])
def test_many_rows_float32_through_float32_tiles(kernel, qtype, T):
    qw = weight(qtype, 300, 512, seed=T)  # 300 rows: several tiles, a partial one
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    out = quant_gemv.quant_linear(x, qw, torch.ones(300), kernel)
    assert_fused_tolerance(out - 1, x, qw.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "int8"])
def test_many_rows_bfloat16(kernel, qtype):
    """bfloat16 x: bfloat16 tiles where the CPU multiplies bf16 fast (the weights rounded to bf16,
    the GEMM's output rounded to bf16, as the dense bf16 path's F.linear), float32 tiles elsewhere."""
    qw = weight(qtype, 200, 512, seed=7)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = quant_gemv.quant_linear(x, qw, None, kernel, float_out=True)
    assert out.dtype == torch.float32
    w = qw.dequantize()
    if kernel.bf16_tiles():
        ref = F.linear(x.double(), w.bfloat16().double())
        torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
    else:
        assert_fused_tolerance(out, x.float(), w)
    rounded = quant_gemv.quant_linear(x, qw, None, kernel)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_rows_under_inference_mode_on_several_threads(kernel, dtype):
    """The worker runs in inference mode: the tile path's torch calls on OpenMP's pool threads
    must see it too (else writing the inference-mode output throws inside the parallel region)."""
    qw = weight("Q4_K", 512, 256, seed=9)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        with torch.inference_mode():
            got = [quant_gemv.quant_linear(x, qw, None, kernel), quant_gemv.quant_linear(x, qw, None, kernel, True),
                   quant_gemv.quant_linear(x, qw, torch.zeros(512), kernel)]
    finally:
        torch.set_num_threads(threads)
    want = [quant_gemv.quant_linear(x, qw, None, kernel), quant_gemv.quant_linear(x, qw, None, kernel, True),
            quant_gemv.quant_linear(x, qw, torch.zeros(512), kernel)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bf16_tiles_exactly_where_the_cpu_has_bf16_matmul(kernel):
    assert kernel.bf16_tiles() == cpu_isa.has_fast_bf16()


def test_fused_path_matches_the_cpu(kernel):
    """AVX-512 where the CPU (as RADIXMESH_CPU_ISA lets it be seen) has it, real AVX2 code on an
    AVX2-only CPU, the portable loop elsewhere."""
    want = "avx512" if cpu_isa.has("avx512f") else ("avx2" if cpu_isa.has("avx2", "fma") else "portable")
    assert kernel.fused_path() == want


def test_int8_per_channel_rounding_rule():
    w = torch.tensor([[1.0, -0.5, 0.25, 127.0] * 8, [0.0] * 32, [-254.0, 127.0, 1.0, -3.0] * 8])
    qw = QuantWeight.int8_per_channel(w)
    assert qw.qtype == "int8" and qw.shape == (3, 32) and qw.nbytes == 3 * 32 + 3 * 4
    q = qw.qs.view(torch.int8).to(torch.int32)
    assert q[0, :4].tolist() == [1, -1, 0, 127]  # 0.5 and -0.5 round away from zero, 0.25 to 0
    assert q[1].abs().sum() == 0 and float(qw.d[1, 0]) == 0.0  # a zero row: scale 0
    assert q[2, :4].tolist() == [-127, 64, 1, -2]  # scale 2: 63.5 -> 64, 0.5 -> 1, -1.5 -> -2
    assert torch.equal(qw.d[:, 0], w.abs().amax(dim=1) / 127)
    dense = torch.randn(16, 64)
    qd = QuantWeight.int8_per_channel(dense)
    assert bool(((qd.dequantize() - dense).abs() <= qd.d[:, :1] / 2 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight.int8_per_channel(torch.randn(4, 48))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "int8"])
def test_cat_rows_fuses_any_format(kernel, qtype):
    a, b = weight(qtype, 8, 256, 1), weight(qtype, 5, 256, 2)
    fused = QuantWeight.cat_rows([a, b])
    assert fused.shape == (13, 256) and fused.nbytes == a.nbytes + b.nbytes
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    x = torch.randn(2, 256)
    assert torch.equal(quant_gemv.quant_linear(x, fused, None, kernel),
                       torch.cat([quant_gemv.quant_linear(x, a, None, kernel),
                                  quant_gemv.quant_linear(x, b, None, kernel)], dim=1))


def test_bad_blocks_and_arguments_say_what_to_do(kernel):
    with pytest.raises(ValueError, match="Q6_K blocks must be uint8"):
        QuantWeight.from_blocks(torch.zeros(2, 200, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="unsupported quantized type 'IQ2_XS'.*radixmesh quantize"):
        QuantWeight.from_blocks(torch.zeros(2, 66, dtype=torch.uint8), "IQ2_XS")
    q6 = weight("Q6_K", 4, 256)
    with pytest.raises(RuntimeError, match=r"d must be contiguous float32 \[N, 16\]"):
        kernel.quant_linear(torch.randn(1, 256), q6.qs, q6.d[:, :8].contiguous(), None, q6.code, None, False)
    with pytest.raises(RuntimeError, match="qtype must be 0..5"):
        kernel.quant_linear(torch.randn(1, 256), q6.qs, q6.d, None, 9, None, False)
    q5k = weight("Q5_K", 4, 256)
    with pytest.raises(RuntimeError, match="need m"):
        kernel.quant_linear(torch.randn(1, 256), q5k.qs, q5k.d, None, q5k.code, None, False)
