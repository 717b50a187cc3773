"""The Triton grouped GEMM (kernels/triton/grouped_gemm.py) against its torch loop over the groups,
on CPU, under Triton's interpreter (enabled per module with the knob, as
tests/unit/test_triton_bitmask.py explains), compiled ahead of time for sm_90, and on CUDA when
there is one. Small shapes: the interpreter runs every program as numpy."""
from __future__ import annotations

import pytest
import torch

from kernels.triton import grouped_gemm as gg
from kernels.triton.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def make(sizes: list[int], k: int, m: int, dtype: torch.dtype, seed: int = 0, offsets_dtype=torch.int64):
    """rows [N, K], offsets [S + 1] (a cumsum, as a caller builds them on the device), weight [S, M, K]."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(sizes), k, generator=g).to(dtype)
    weight = (torch.randn(len(sizes), m, k, generator=g) / k ** 0.5).to(dtype)
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(offsets_dtype)
    return rows, offsets, weight


def sums_close(got: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> bool:
    """Within K float32 rounding steps of the terms' magnitudes (|rows| @ |W_s|^T) of the float32
    sums, plus the one rounding into the output dtype: the bound a reordered sum keeps. bfloat16
    gets a whole unit in the last place: triton 3.9's interpreter truncates float32 to bfloat16
    (a GPU rounds to nearest)."""
    want = grouped_gemm_reference(rows.float(), offsets, weight.float())
    terms = grouped_gemm_reference(rows.float().abs(), offsets, weight.float().abs())
    unit = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -7}[rows.dtype]
    bound = rows.shape[1] * 2.0 ** -23 * terms + unit * want.abs() * 1.01 + 1e-30
    return bool(((got.float() - want).abs() <= bound).all())


SHAPES = {  # name → (group sizes, K, M)
    "decode": ([0, 3, 17, 1], 64, 48),  # an empty first group, a group over two 16-row tiles
    "prefill": ([40, 0, 0, 70], 100, 130),  # taller tiles, three column tiles, a partial K step
    "many_groups": ([2, 0, 5, 0, 0, 1, 9, 3, 0, 4, 1, 1, 0, 6, 2, 0, 3, 1, 0, 7], 33, 20),  # S_PAD 32
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_the_reference(dtype, shape):
    sizes, k, m = SHAPES[shape]
    rows, offsets, weight = make(sizes, k, m, dtype, seed=len(sizes))
    got = grouped_gemm(rows, offsets, weight)
    assert got.dtype == dtype and got.shape == (sum(sizes), m)
    assert sums_close(got, rows, offsets, weight)
    if dtype == torch.float32:
        torch.testing.assert_close(got, grouped_gemm_reference(rows, offsets, weight), atol=1e-5, rtol=1e-5)


def test_int32_offsets_and_strided_rows():
    """offsets as int32; rows a column slice of a wider tensor (row stride != K)."""
    sizes = [0, 3, 17, 1]
    _, offsets, weight = make(sizes, 64, 48, torch.float32, offsets_dtype=torch.int32)
    wide = torch.randn(sum(sizes), 70, generator=torch.Generator().manual_seed(4))
    rows = wide[:, 3:67]
    assert rows.stride(0) == 70
    torch.testing.assert_close(grouped_gemm(rows, offsets, weight), grouped_gemm_reference(rows, offsets, weight),
                               atol=1e-5, rtol=1e-5)


def test_the_check_tells_groups_apart():
    """Not tautological: a kernel that gave a row its neighbour group's weight would fail."""
    rows, offsets, weight = make([0, 3, 17, 1], 64, 48, torch.float32)
    swapped = weight[[0, 2, 1, 3]].contiguous()
    assert not sums_close(grouped_gemm_reference(rows, offsets, swapped), rows, offsets, weight)


def test_empty_inputs():
    weight = torch.randn(4, 48, 64)
    for dtype in (torch.int32, torch.int64):
        out = grouped_gemm(torch.zeros(0, 64), torch.zeros(5, dtype=dtype), weight)
        assert out.shape == (0, 48) and out.dtype == torch.float32
    no_groups = grouped_gemm(torch.zeros(0, 64), torch.zeros(1, dtype=torch.int64), torch.zeros(0, 48, 64))
    assert no_groups.shape == (0, 48)
    no_k = grouped_gemm(torch.zeros(3, 0), torch.tensor([0, 1, 3]), torch.zeros(2, 5, 0))
    assert torch.equal(no_k, torch.zeros(3, 5))


def test_one_launch_for_every_group(monkeypatch):
    """Never a launch per group: one, its row tiles no more than the rows."""
    launches = []
    real = gg._kernel(True)

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(gg, "_kernel", lambda interpret: Counting())
    sizes, k, m = SHAPES["many_groups"]
    rows, offsets, weight = make(sizes, k, m, torch.float32)
    grouped_gemm(rows, offsets, weight)
    assert len(launches) == 1 and launches[0][0] <= sum(sizes)


@pytest.mark.parametrize("seed", range(5))
def test_the_grid_has_a_tile_for_every_row(seed):
    """The grid's row tiles, min(ceil(N / BLOCK_N) + S, N), cover any split of N rows into S groups."""
    g = torch.Generator().manual_seed(seed)
    for block in (16, 32, 64):
        groups = int(torch.randint(1, 300, (1,), generator=g))
        sizes = torch.randint(0, 3 * block, (groups,), generator=g) * (torch.rand(groups, generator=g) < 0.7)
        n = int(sizes.sum())
        assert int(((sizes + block - 1) // block).sum()) <= min(-(-n // block) + groups, n)


def test_block_configs_are_tile_sizes_tl_dot_takes():
    assert gg.block_config(8, 128).block_n == 16 and gg.block_config(4096 * 8, 128).block_n == 64
    for n, s in ((1, 1), (16, 1), (17, 1), (64, 1), (65, 1), (100_000, 8), (0, 0)):
        c = gg.block_config(n, s)
        assert all(v >= 16 and v & (v - 1) == 0 for v in (c.block_n, c.block_m, c.block_k))


def _good():
    """Valid arguments: N 4 rows in 2 groups, K 8, M 6."""
    return dict(rows=torch.zeros(4, 8), offsets=torch.tensor([0, 1, 4]), weight=torch.zeros(2, 6, 8))


@pytest.mark.parametrize("change, match", [
    (dict(rows=torch.zeros(4, 8, dtype=torch.float64)), "float32/bfloat16/float16"),
    (dict(rows=torch.zeros(4, 8, 1)), r"rows must be \[N, K\]"),
    (dict(rows=torch.zeros(8, 4).t()), "contiguous last dim"),
    (dict(weight=torch.zeros(2, 6, 9)), r"weight must be \[S, M, K = 8\]"),
    (dict(weight=torch.zeros(2, 6, 8, dtype=torch.bfloat16)), "rows' dtype"),
    (dict(weight=torch.zeros(2, 8, 6).transpose(1, 2)), "weight must be contiguous"),
    (dict(offsets=torch.tensor([0, 4])), r"offsets must be int32/int64 \[S \+ 1 = 3\]"),
    (dict(offsets=torch.tensor([0.0, 1.0, 4.0])), "int32/int64"),
    (dict(offsets=torch.tensor([0, 3, 2])), "never decrease"),
    (dict(offsets=torch.tensor([0, 1, 3])), "end at N = 4"),
    (dict(offsets=torch.tensor([1, 1, 4])), "start at 0"),
    (dict(weight=torch.zeros(2, 6, 8, device="meta")), "move it first"),
], ids=["rows-dtype", "rows-dims", "rows-stride", "k", "weight-dtype", "weight-layout", "offsets-len",
        "offsets-dtype", "decreasing", "short", "start", "device"])
def test_bad_inputs_raise_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm(**{**_good(), **change})
    with pytest.raises(ValueError, match=match):  # the reference keeps the same contract
        grouped_gemm_reference(**{**_good(), **change})


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            grouped_gemm(**_good())


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype, precision, n", [("*bf16", "tf32", 8), ("*fp16", "tf32", 2000), ("*fp32", "ieee", 60000)])
def test_compiles_for_the_gpu(dtype, precision, n, tmp_path):
    """The interpreter runs the kernel as Python; the compiler is stricter. Built for sm_90 ahead of
    time with each size's tiles, no GPU needed (triton ships ptxas)."""
    from triton.runtime.jit import JITFunction

    if not isinstance(triton.language.standard._sum_combine, JITFunction):
        pytest.skip("TRITON_INTERPRET=1 at import: triton's own reduction helpers are interpreted")
    cfg = gg.block_config(n, 128)
    signature = {"rows_ptr": dtype, "rows_stride": "i64", "offsets_ptr": "*i64", "w_ptr": dtype, "out_ptr": dtype,
                 "S": "i32", "M": "i32", "K": "i32"}
    constexprs = {"S_PAD": 128, "BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k,
                  "PRECISION": precision, "UPCAST": False}
    compiled = compile_for_sm90(gg._kernel(False), signature, constexprs, tmp_path,
                                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64, 2000])
def test_compiled_kernel_on_cuda(dtype, tokens):
    """Mixture-of-experts shapes: tokens x top-8 of 128 experts, hidden 1024, 2 x 384 gate/up rows."""
    g = torch.Generator().manual_seed(tokens)
    experts = torch.randint(0, 128, (tokens * 8,), generator=g)
    sizes = torch.bincount(experts, minlength=128).tolist()
    rows, offsets, weight = make(sizes, 1024, 768, dtype, seed=tokens)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        got = grouped_gemm(rows.cuda(), offsets.cuda(), weight.cuda()).cpu()
    assert sums_close(got, rows, offsets, weight)
