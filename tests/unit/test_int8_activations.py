"""Int8 activations for the few-row quantized matmul (kernels/cpu/int8_activations.h, the
worker's --quant-activations int8): against a float64 reference of the same rounding, row by row
independent of the rows beside it, only for the formats it covers, and refused where it does
not apply, and kept float32 where the build has no int8 path (it has one wherever AVX2 is: the
512-bit VNNI path, or the 256-bit one of int8_activations_avx2.h)."""
from __future__ import annotations

import logging

import pytest
import torch

from bench.common.quant_blocks import weight
from kernels import quant_gemv
from kernels.quant_gemv import Int8Activations, QuantWeight
from services.worker.config import WorkerConfig

MODULE = quant_gemv.load()
needs_int8 = pytest.mark.skipif(MODULE is None or not MODULE.int8_activations(),
                                reason="quant_gemv has no int8 activations here (needs AVX2 or AVX512-VNNI)")


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as the kernel rounds it, back in float64: per group of 32, dx = max|x| / 127 and
    q = round-half-even(x * (1 / dx)), both in float32; returns dx * q."""
    groups = x.reshape(x.shape[0], -1, 32)
    dx = groups.abs().amax(dim=-1, keepdim=True) / 127.0  # float32, as the kernel divides
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(groups * inv)  # torch.round: half to even, as cvtps2dq
    return (dx.double() * q.double()).reshape(x.shape)


def reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return (quantized_x(x) @ w.dequantize().double().T).float()


def int8_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return MODULE.quant_linear(x, w.qs, w.d, w.m, w.code, None, True, True)


@needs_int8
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [128, 192])
def test_matches_the_float64_reference_of_the_same_rounding(qtype, rows, k):
    """K = 128: two pairs of groups (Q4_1's four-group step on AVX2); 192: three (that step, then
    a last pair, as the default model's 576 columns run)."""
    w = weight(qtype, 40, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by zero
    got, want = int8_linear(x, w), reference(x, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    exact = MODULE.quant_linear(x, w.qs, w.d, w.m, w.code, None, True)  # float32 activations
    assert not torch.equal(got, exact)  # it did quantize x ...
    assert float((got - exact).norm() / exact.norm()) < 0.02  # ... to within a rounding of int8


@needs_int8
def test_a_row_does_not_depend_on_the_rows_beside_it():
    w = weight("Q4_1", 36, 192)
    x = torch.randn(8, 192, generator=torch.Generator().manual_seed(1))
    together = int8_linear(x, w)
    for r in range(8):
        assert torch.equal(int8_linear(x[r:r + 1], w)[0], together[r])


@needs_int8
@pytest.mark.parametrize("qtype", ["Q5_0", "Q6_K"])
def test_formats_it_does_not_cover_keep_float32_activations(qtype):
    w = weight(qtype, 16, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(int8_linear(x, w), MODULE.quant_linear(x, w.qs, w.d, w.m, w.code, None, True))


@needs_int8
def test_more_rows_than_the_fused_path_take_the_tiles_unchanged():
    w = weight("Q4_1", 32, 64)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(int8_linear(x, w), MODULE.quant_linear(x, w.qs, w.d, w.m, w.code, None, True))


@needs_int8
def test_the_module_wrapper_turns_it_on_for_every_call():
    w = weight("Q8_0", 24, 64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    wrapped = Int8Activations(MODULE)
    assert torch.equal(quant_gemv.quant_linear(x, w, module=wrapped, float_out=True), int8_linear(x, w))
    assert wrapped.fused_path() == MODULE.fused_path()  # everything else passes through


def test_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="exact mode"):
        WorkerConfig(dtype="float32", quant_activations="int8")
    with pytest.raises(ValueError, match="--quantization gguf"):
        WorkerConfig(quantization="gguf", quant_activations="int8")
    with pytest.raises(ValueError, match="auto, float32 or int8"):
        WorkerConfig(quant_activations="int4")


def test_without_an_int8_path_the_worker_keeps_float32_activations(checkpoint, monkeypatch, caplog):
    """The fallback, forced: a quant_gemv build without an int8 path (a CPU without AVX2) asked
    for int8 serves with float32 activations and says so."""
    from services.worker.model_runner import ModelRunner
    if MODULE is None:
        pytest.skip("the quantized-linear kernel is not built here")

    class WithoutInt8:
        def int8_activations(self) -> bool:
            return False

        def __getattr__(self, name):
            return getattr(MODULE, name)

    monkeypatch.setattr(quant_gemv, "load", WithoutInt8)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(WorkerConfig(kv_cache_bytes=8 << 20, max_requests=2, quant_activations="int8"),
                             checkpoint)
    assert not runner.backend.int8_activations
    assert "without an int8 path" in caplog.text
    assert runner.quantized_weights > 0
    assert not any(isinstance(lin._quant_kernel, Int8Activations) for lin in runner.model.step_linears())
    if runner.model.decode_stack is not None:
        assert not runner.model.decode_stack.int8_activations


def test_auto_is_int8_wherever_the_build_has_it_outside_the_exact_mode(checkpoint, monkeypatch, caplog):
    """The default (auto) takes int8 activations on a build with an int8 path, also where --dtype
    auto runs float32 (a CPU without fast bfloat16), and keeps float32 in the exact mode (--dtype
    float32 asked for), under other weight formats and on a build without one, silently."""
    from services.worker.attention.cpu_backend import _int8_activations
    if MODULE is None:
        pytest.skip("the quantized-linear kernel is not built here")
    assert WorkerConfig().quant_activations == "auto"
    with caplog.at_level(logging.WARNING):
        assert _int8_activations(WorkerConfig()) == MODULE.int8_activations()
        assert _int8_activations(WorkerConfig(dtype="bfloat16")) == MODULE.int8_activations()
        with monkeypatch.context() as patched:  # a CPU without fast bfloat16: auto runs float32
            from kernels import cpu_isa
            patched.setattr(cpu_isa, "has_fast_bf16", lambda: False)
            assert WorkerConfig().torch_dtype == torch.float32
            assert _int8_activations(WorkerConfig()) == MODULE.int8_activations()
        assert not _int8_activations(WorkerConfig(dtype="float32"))
        assert not _int8_activations(WorkerConfig(quantization="int8"))
        assert not _int8_activations(WorkerConfig(quant_activations="float32"))

        class WithoutInt8:
            def int8_activations(self) -> bool:
                return False
        monkeypatch.setattr(quant_gemv, "load", WithoutInt8)
        assert not _int8_activations(WorkerConfig())
    assert "int8 path" not in caplog.text and "exact mode" not in caplog.text


@needs_int8
def test_the_build_names_its_int8_path():
    """AVX512-VNNI where the build targets it, else the 256-bit AVX2 path (the forced-AVX2 pass
    runs the latter on any CPU, so both are exercised on an AVX-512 machine)."""
    from kernels import cpu_isa
    wide = MODULE.fused_path() == "avx512" and cpu_isa.has("avx512_vnni")
    assert MODULE.int8_path() == ("avx512-vnni" if wide else "avx2")
