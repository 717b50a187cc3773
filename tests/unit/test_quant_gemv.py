"""Linear layers on the GGUF file's own Q8_0/Q4_1 blocks: the C++ kernel against the
float32 matmul with the dequantized weights, the block split against gguf's own
dequantizer, the routing by row count in `Linear`, and the real model's runner."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import quant_gemv
from kernels.quant_gemv import QuantWeight
from services.worker.model.linear import Linear


@pytest.fixture(scope="module")
def kernel():
    module = quant_gemv.load()
    assert module is not None, "the CPU kernel must build where a compiler is present (CI has one)"
    return module


def _quantized(N: int, K: int, qtype: str, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((N, K), dtype=np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return QuantWeight.from_blocks(torch.from_numpy(blocks), qtype), blocks


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_block_split_dequantizes_like_gguf(qtype):
    qw, blocks = _quantized(70, 96, qtype)
    assert qw.shape == (70, 96) and qw.d.dtype == torch.float32
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    assert torch.equal(qw.dequantize(), torch.from_numpy(ref).float())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("N,K", [(5, 32), (67, 576), (130, 1536)])  # N off the kernel's row groups of 4
@pytest.mark.parametrize("T", [1, 2, 3, 8, 11])  # 11: the many-row path (float32 tiles for float32 x)
def test_kernel_matches_float32_matmul(kernel, qtype, N, K, T):
    qw, _ = _quantized(N, K, qtype, seed=N + T)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    bias = torch.randn(N)
    out = quant_gemv.quant_linear(x, qw, bias, kernel)
    ref = F.linear(x.double(), qw.dequantize().double(), bias.double()).float()
    torch.testing.assert_close(out, ref, atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, qtype):
    """Bit for bit, for every row count of the fused path (at most FUSED_MAX_ROWS): speculation's
    verify steps (several rows of one request) must give the logits a one-row decode step gives
    (services/worker/model_runner.py). More rows go through a GEMM, whose sums are its own."""
    qw, _ = _quantized(67, 576, qtype, seed=3)
    rows = quant_gemv.FUSED_MAX_ROWS
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([quant_gemv.quant_linear(x[i:i + 1], qw, None, kernel) for i in range(rows)])
    for T in range(2, rows + 1):
        assert torch.equal(quant_gemv.quant_linear(x[:T], qw, None, kernel), alone[:T]), T


def test_bfloat16_in_float32_or_bfloat16_out(kernel):
    qw, _ = _quantized(40, 64, "Q4_1")
    x = torch.randn(3, 64).to(torch.bfloat16)
    ref = F.linear(x.float(), qw.dequantize())
    as_float = quant_gemv.quant_linear(x, qw, None, kernel, float_out=True)
    assert as_float.dtype == torch.float32
    torch.testing.assert_close(as_float, ref, atol=1e-4, rtol=1e-5)
    rounded = quant_gemv.quant_linear(x, qw, None, kernel)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, as_float.to(torch.bfloat16))


def test_fused_rows_and_bad_inputs(kernel):
    a, _ = _quantized(8, 64, "Q4_1", 1)
    b, _ = _quantized(4, 64, "Q4_1", 2)
    fused = QuantWeight.cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one type"):
        QuantWeight.cat_rows([a, _quantized(4, 64, "Q8_0")[0]])
    with pytest.raises(ValueError, match="unsupported"):
        QuantWeight.from_blocks(torch.zeros(2, 84, dtype=torch.uint8), "Q2_K")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quant_linear(torch.randn(1, 48), a.qs, a.d, a.m, 1, None, False)
    with pytest.raises(RuntimeError, match="need m"):
        kernel.quant_linear(torch.randn(1, 64), a.qs, a.d, None, 1, None, False)


def test_linear_uses_blocks_only_up_to_max_rows(kernel):
    """The dense weight is zeroed: rows <= max_rows must come from the blocks, more from it."""
    qw, _ = _quantized(24, 64, "Q8_0")
    layer = Linear(64, 24, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    layer.set_quant(qw, 2, kernel)
    with torch.inference_mode():
        for rows in (1, 2):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, qw.dequantize()), atol=1e-4, rtol=1e-5)
        assert torch.count_nonzero(layer(torch.randn(3, 64))) == 0
        layer.set_quant(None, 0)
        assert layer.quant is None and torch.count_nonzero(layer(torch.randn(1, 64))) == 0
    with pytest.raises(ValueError, match="does not match"):
        layer.set_quant(_quantized(24, 32, "Q8_0")[0], 2, kernel)


def test_default_model_decodes_the_same_on_blocks_and_dense_weights(checkpoint):
    """The real SmolLM2 file (Q4_1 projections, Q8_0 tied embedding): every one of its 211
    quantized weights is used, and a batch-1 decode step's float32 logits equal the dense
    float32 weights' within summation-order noise, with the same greedy token."""
    from services.common.sampling_params import SamplingParams
    from services.step.contract import NewRequestSpec, StepItem, StepPlan
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    ckpt = checkpoint
    assert len(ckpt.quantized) == 211
    prompt = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]
    logits = {}
    for rows in (2, 0):
        runner = ModelRunner(WorkerConfig(dtype="float32", kv_cache_bytes=64 << 20, max_requests=2,
                                          quant_max_rows=rows), ckpt)
        assert runner.quantized_weights == (211 if rows else 0)
        spec = NewRequestSpec("r", prompt, [], SamplingParams(temperature=0), 0)
        runner.execute(StepPlan(0, [spec], [StepItem("r", prompt, 0, [0], True, False)]))
        out, _ = runner.compute_logits(StepPlan(1, [], [StepItem("r", [28], len(prompt), [])]))
        logits[rows] = out[0]
    torch.testing.assert_close(logits[2], logits[0], atol=2e-3, rtol=1e-4)
    assert int(logits[2].argmax()) == int(logits[0].argmax())


def test_avx512_matmul_is_compiled_in_exactly_where_the_cpu_has_it(kernel):
    """The AVX-512 matmul where the CPU (as RADIXMESH_CPU_ISA lets it be seen) has AVX-512,
    the portable loop elsewhere: an AVX2-only CPU must never get AVX-512 instructions."""
    from kernels import cpu_isa
    assert kernel.has_avx512_path() == cpu_isa.has("avx512f")
