"""The Triton FP8 W8A16 GEMM (kernels/triton/fp8_gemm.py) against its float32 torch reference, on
CPU, under Triton's interpreter (enabled per module with the knob, as tests/unit/test_triton_bitmask.py
explains), compiled ahead of time for sm_90, and on CUDA when there is one."""
from __future__ import annotations

import pytest
import torch

from kernels.triton import fp8_gemm
from kernels.triton.fp8_gemm import E4M3, fp8_linear, fp8_linear_reference
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def every_code() -> torch.Tensor:
    """The 254 finite e4m3fn values (both zeros, subnormals, +-448), as a float8 [254]."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F].view(E4M3)


def random_weight(g, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes spread over the whole e4m3 range (subnormals included) and per-row scales."""
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 2.6, k)[torch.randperm(k, generator=g)])
    return w.clamp(-448, 448).to(E4M3), torch.rand(n, generator=g) * 0.02 + 1e-3


def sums_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> bool:
    """float32 sums of K products (and the bias) in another order: within K float32 rounding steps
    of the sum of the terms' magnitudes (|x| @ |W|^T + |bias|), the bound a reordered sum keeps."""
    terms = x.float().abs() @ (w.float().abs() * scale[:, None]).t()  # [M, N]
    if bias is not None:
        terms = terms + bias.float().abs()
    return bool(((got - want).abs() <= x.shape[1] * 2.0 ** -23 * terms + 1e-30).all())


# float_out compares the float32 sums themselves; a half dtype's output rounding is checked apart.
OUT_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=8e-3), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 37, 45), (7, 130, 200), (64, 64, 129), (130, 97, 33)],
                         ids=["decode1", "decode7", "decode64", "prefill130"])
def test_kernel_matches_the_float32_reference(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    w, scale = random_weight(g, n, k)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    want = fp8_linear_reference(x, w, scale, bias, float_out=True)
    got = fp8_linear(x, w, scale, bias, float_out=True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert sums_close(got, want, x, w, scale, bias)
    out = fp8_linear(x, w, scale, bias)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(out, got)
    else:
        torch.testing.assert_close(out.float(), want, **OUT_TOL[dtype])


def test_every_byte_widens_exactly():
    """x = I picks out W^T column by column: every finite e4m3 value, subnormals and both zeros
    included, comes back exactly (float32, scale 1; a -0.0 sums to +0.0), and a scale multiplies
    each row."""
    codes = every_code().reshape(2, 127)
    got = fp8_linear(torch.eye(127), codes, torch.ones(2), float_out=True)
    assert torch.equal(got, codes.float().t())
    scale = torch.tensor([0.5, 3.0])
    assert torch.equal(fp8_linear(torch.eye(127), codes, scale), codes.float().t() * scale)


def test_strided_rows_no_bias_and_a_long_k():
    """x as a column slice of a wider tensor (row stride != K), K over several K steps, no bias."""
    g = torch.Generator().manual_seed(3)
    w, scale = random_weight(g, 70, 300)
    wide = torch.randn(20, 310, generator=g).to(torch.bfloat16)
    x = wide[:, 5:305]
    assert sums_close(fp8_linear(x, w, scale, float_out=True), fp8_linear_reference(x, w, scale, float_out=True),
                      x, w, scale)


def test_empty_shapes():
    w, scale = torch.zeros(5, 8).to(E4M3), torch.ones(5)
    assert fp8_linear(torch.zeros(0, 8), w, scale).shape == (0, 5)
    bias = torch.arange(3.0)
    got = fp8_linear(torch.zeros(2, 0), torch.zeros(3, 0).to(E4M3), torch.ones(3), bias)
    assert torch.equal(got, bias.expand(2, 3))


def test_block_configs_cover_decode_and_prefill():
    """Decode steps take 16-row tiles; tiles are powers of two of at least 16 (tl.dot's minimum)."""
    assert fp8_gemm.block_config(1).block_m == 16 and fp8_gemm.block_config(64).block_m == 64
    for m in (1, 16, 17, 64, 65, 4096):
        c = fp8_gemm.block_config(m)
        assert all(v >= 16 and v & (v - 1) == 0 for v in (c.block_m, c.block_n, c.block_k))


def test_the_check_catches_a_broken_kernel():
    """Not tautological: at the tolerances above the reference tells apart a kernel that drops the
    sign bit, misses the last K step, or shifts the scales by one row."""
    g = torch.Generator().manual_seed(5)
    w, scale = random_weight(g, 40, 200)
    x = torch.randn(7, 200, generator=g)
    good = fp8_linear_reference(x, w, scale, float_out=True)
    unsigned = (w.view(torch.uint8) & 0x7F).view(E4M3)
    short = w.clone()
    short[:, 128:] = 0
    for bad in (fp8_linear_reference(x, unsigned, scale, float_out=True),
                fp8_linear_reference(x, short, scale, float_out=True),
                fp8_linear_reference(x, w, scale.roll(1), float_out=True)):
        assert not sums_close(bad, good, x, w, scale)


def _good():
    """Valid arguments: M 3, K 8, N 4."""
    return dict(x=torch.zeros(3, 8), w=torch.zeros(4, 8).to(E4M3), scale=torch.ones(4), bias=torch.zeros(4))


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "float32/bfloat16/float16"),
    (dict(x=torch.zeros(3, 8, 1)), r"x must be \[M, K\]"),
    (dict(x=torch.zeros(8, 3).t()), "contiguous last dim"),
    (dict(w=torch.zeros(4, 8, dtype=torch.uint8)), "float8_e4m3fn"),
    (dict(w=torch.zeros(4, 8).to(torch.float8_e5m2)), "float8_e4m3fn"),
    (dict(w=torch.zeros(4, 9).to(E4M3)), "K = 8 columns, w 9"),
    (dict(w=torch.zeros(8, 4).to(E4M3).t()), "w must be contiguous"),
    (dict(scale=torch.ones(4, dtype=torch.bfloat16)), "scale must be float32"),
    (dict(scale=torch.ones(5)), r"scale must be float32 \[N = 4\]"),
    (dict(bias=torch.zeros(5)), "bias must be"),
    (dict(bias=torch.zeros(4, dtype=torch.int32)), "bias must be"),
    (dict(scale=torch.ones(4, device="meta")), "move it first"),
], ids=["x-dtype", "x-dims", "x-stride", "w-uint8", "w-e5m2", "k", "w-layout", "scale-dtype", "scale-shape",
        "bias-shape", "bias-dtype", "device"])
def test_bad_inputs_raise_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        fp8_linear(**{**_good(), **change})
    with pytest.raises(ValueError, match=match):  # the reference keeps the same contract
        fp8_linear_reference(**{**_good(), **change})


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            fp8_linear(**_good())


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype, precision, m", [("*bf16", "tf32", 1), ("*fp16", "tf32", 64), ("*fp32", "ieee", 4096)])
def test_compiles_for_the_gpu(dtype, precision, m, tmp_path):
    """The interpreter runs the kernel as Python; the compiler is stricter. Built for sm_90 ahead of
    time with each row-count's tiles, no GPU needed (triton ships ptxas)."""
    kernel = fp8_gemm._kernel(False)
    cfg = fp8_gemm.block_config(m)
    signature = {"x_ptr": dtype, "x_stride": "i64", "w_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": dtype, "y_ptr": dtype,
                 "M": "i32", "N": "i32", "K": "i32", "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRECISION": "constexpr", "UPCAST": "constexpr"}
    constexprs = {"HAS_BIAS": m != 1, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "PRECISION": precision, "UPCAST": False}
    compiled = compile_for_sm90(kernel, signature, constexprs, tmp_path,
                                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 64, 130, 1000])
def test_compiled_kernel_on_cuda(dtype, m):
    g = torch.Generator().manual_seed(m)
    w, scale = random_weight(g, 1000, 576)
    x, bias = torch.randn(m, 576, generator=g).to(dtype), torch.randn(1000, generator=g).to(dtype)
    want = fp8_linear_reference(x, w, scale, bias, float_out=True)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        args = [t.cuda() for t in (x, w, scale, bias)]
        got = fp8_linear(*args, float_out=True).cpu()
        out = fp8_linear(*args).cpu()
    assert sums_close(got, want, x, w, scale, bias)  # float32 runs "ieee" (no tf32): the same bound
    if dtype != torch.float32:
        torch.testing.assert_close(out.float(), want, **OUT_TOL[dtype])
