"""The Triton paged attention kernels (kernels/triton/decode_attention.py, extend_attention.py)
against their float32 torch references, on CPU, under Triton's interpreter (enabled per module
with the knob, as tests/unit/test_triton_bitmask.py explains): page sizes 1/16/64, GQA ratios
1/3/8, ragged batches, split-K, sliding window, soft-cap, FP8 pools, fp32/bf16/fp16. Small
shapes: the interpreter runs every program as numpy. The compiled path is built ahead of time
for sm_90 without a GPU, and runs on CUDA in the gpu-marked test."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import quantize_kv
from kernels.triton import decode_attention as da
from kernels.triton import extend_attention as ea
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def make_pool(g, pages: int, page_size: int, hkv: int, d: int, dtype, amp: float = 1.0):
    """k, v [pages * page_size, Hkv, D] of random rows; FP8 pools hold quantize_kv's bytes (rotated,
    scaled) with 1 in 16 bytes replaced by a random subnormal code (exponent bits 0)."""
    k, v = (torch.randn(pages * page_size, hkv, d, generator=g) * amp for _ in range(2))
    if dtype not in FP8:
        return k.to(dtype), v.to(dtype)
    out = []
    for t in (k, v):
        raw = quantize_kv(t, dtype).view(torch.uint8)
        sub = torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8) & (0x87 if dtype == FP8[0] else 0x83)
        pick = torch.randint(0, 16, raw.shape, generator=g) == 0
        out.append(torch.where(pick, sub, raw).view(dtype))
    return out[0], out[1]


def make_table(g, lens: list[int], page_size: int, pages: int, dtype=torch.int64) -> torch.Tensor:
    """[B, P] distinct random pages covering each length (padding entries -1: never read)."""
    need = [-(-n // page_size) for n in lens]
    width = max(max(need), 1) + 1
    perm = torch.randperm(pages, generator=g)
    table = torch.full((len(lens), width), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    return table.to(dtype)


def query(g, rows: int, h: int, d: int, dtype, amp: float = 1.0) -> torch.Tensor:
    """[rows, H, D], a strided view (the heads of a wider fused projection), as the model passes q."""
    wide = torch.randn(rows, h + 2, d, generator=g) * amp
    return wide.to(dtype)[:, 1:h + 1]


# (page size, H, Hkv, D): page sizes 1/16/64, GQA 1/3/8, a head dim that is not a power of two
SHAPES = [(1, 4, 4, 64), (16, 6, 2, 48), (64, 16, 2, 32)]
SHAPE_IDS = ["p1-g1", "p16-g3", "p64-g8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size, h, hkv, d", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_the_reference(dtype, page_size, h, hkv, d):
    g = torch.Generator().manual_seed(page_size * 7 + h)
    lens = [1, 37, 150, 64, 0]  # one token, mid-page, several pages, exactly a page, empty (zeros)
    pages = 4 * 150 // page_size + 8
    k, v = make_pool(g, pages, page_size, hkv, d, dtype)
    table = make_table(g, lens, page_size, pages, torch.int32 if page_size == 16 else torch.int64)
    q, kv_lens = query(g, len(lens), h, d, dtype), torch.tensor(lens)
    got = da.decode_attention(q, k, v, table, kv_lens, page_size, d ** -0.5)
    want = da.decode_attention_reference(q, k, v, table, kv_lens, page_size, d ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    # not tautological: a kernel one key short (or reading the wrong pages) would be told apart
    short = da.decode_attention_reference(q, k, v, table, (kv_lens - 1).clamp(min=0), page_size, d ** -0.5)
    assert not torch.allclose(short[1:4].float(), want[1:4].float(), **TOL[dtype])


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_split_k_equals_one_split(splits):
    """Chunks of one request's keys, reduced, equal the single pass (fp32: to rounding); 16 splits
    of a 3-key request leave most chunks empty."""
    g = torch.Generator().manual_seed(splits)
    lens, page_size, pages = [3, 300, 129], 16, 64
    k, v = make_pool(g, pages, page_size, 2, 64, torch.float32)
    table, kv_lens = make_table(g, lens, page_size, pages), torch.tensor(lens, dtype=torch.int32)
    q = query(g, 3, 8, 64, torch.float32)
    one = da.decode_attention(q, k, v, table, kv_lens, page_size, 0.125, num_splits=1)
    many = da.decode_attention(q, k, v, table, kv_lens, page_size, 0.125, num_splits=splits)
    torch.testing.assert_close(many, one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(many, da.decode_attention_reference(q, k, v, table, kv_lens, page_size, 0.125),
                               **TOL[torch.float32])


def test_the_split_count_follows_batch_and_length():
    cpu = torch.device("cpu")
    assert da.choose_num_splits(1, 8, 100, cpu) == 1  # short: one chunk
    assert da.choose_num_splits(1, 8, 4096, cpu) == 16  # long, small batch: 4096 / 256 chunks
    assert da.choose_num_splits(1, 1, 1 << 20, cpu) == da.MAX_SPLITS
    assert da.choose_num_splits(64, 8, 4096, cpu) == 1  # the batch fills the GPU by itself
    assert da.choose_num_splits(8, 8, 4096, cpu) == 5  # ceil(264 / 64)


@pytest.mark.parametrize("window, softcap", [(50, None), (None, 2.0), (17, 1.5)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_window_and_softcap(window, softcap, splits):
    g = torch.Generator().manual_seed(11)
    lens, page_size, pages = [1, 40, 200], 16, 32
    k, v = make_pool(g, pages, page_size, 3, 64, torch.float32)
    table, kv_lens = make_table(g, lens, page_size, pages), torch.tensor(lens)
    q = query(g, 3, 9, 64, torch.float32, amp=3.0)  # scores large enough for the cap to bite
    opts = dict(window=window, softcap=softcap)
    got = da.decode_attention(q, k, v, table, kv_lens, page_size, 0.125, num_splits=splits, **opts)
    want = da.decode_attention_reference(q, k, v, table, kv_lens, page_size, 0.125, **opts)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    plain = da.decode_attention_reference(q, k, v, table, kv_lens, page_size, 0.125)
    assert (want[2] - plain[2]).abs().max() > 1e-2  # the variant changed what the long request sees


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_fp8_pools_are_widened_in_the_kernels(fp8, qdtype):
    """Both kernels read an FP8 pool as its bytes times the format's scale (the rotation is the
    caller's), subnormal codes included."""
    g = torch.Generator().manual_seed(3)
    page_size, pages = 16, 24
    k, v = make_pool(g, pages, page_size, 2, 64, fp8, amp=2.0)
    lens = [1, 90, 33]
    table, kv_lens = make_table(g, lens, page_size, pages), torch.tensor(lens)
    q = query(g, 3, 6, 64, qdtype)
    got = da.decode_attention(q, k, v, table, kv_lens, page_size, 0.125, num_splits=2)
    torch.testing.assert_close(got, da.decode_attention_reference(q, k, v, table, kv_lens, page_size, 0.125),
                               **TOL[qdtype])
    qe, cu_q, start = query(g, 20, 6, 64, qdtype), torch.tensor([0, 1, 20, 20]), torch.tensor([0, 71, 33])
    got = ea.extend_attention(qe, k, v, table, cu_q, start, page_size, 0.125)
    torch.testing.assert_close(got, ea.extend_attention_reference(qe, k, v, table, cu_q, start, page_size, 0.125),
                               **TOL[qdtype])


# The largest shape takes ~0.6 s per dtype under Triton's interpreter: `make test` only.
EXTEND_SHAPES = [pytest.param(*shape, id=name, marks=[pytest.mark.slow] if name == "p64-g8" else [])
                 for shape, name in zip(SHAPES, SHAPE_IDS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size, h, hkv, d", EXTEND_SHAPES)
def test_extend_matches_the_reference(dtype, page_size, h, hkv, d):
    """A ragged batch: one query on an empty prefix, a prefill with no prefix across two query
    tiles, a chunk after a cached prefix, an empty item, a single token after a long prefix."""
    g = torch.Generator().manual_seed(page_size + h)
    q_lens, starts = [1, 70, 9, 0, 1], [0, 0, 41, 5, 130]
    lens = [s + n for s, n in zip(starts, q_lens)]
    pages = 2 * sum(lens) // page_size + 8
    k, v = make_pool(g, pages, page_size, hkv, d, dtype)
    table = make_table(g, lens, page_size, pages, torch.int32 if page_size == 1 else torch.int64)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q, start = query(g, sum(q_lens), h, d, dtype), torch.tensor(starts)
    got = ea.extend_attention(q, k, v, table, cu_q, start, page_size, d ** -0.5)
    want = ea.extend_attention_reference(q, k, v, table, cu_q, start, page_size, d ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    # not tautological: without the causal mask (every query seeing its item's last key) it differs
    mid = slice(int(cu_q[1]), int(cu_q[2]) - 1)  # the prefill's rows but its last
    n = mid.stop - mid.start
    everything = da.decode_attention_reference(q[mid], k, v, table[1:2].expand(n, -1), torch.full((n,), 70),
                                               page_size, d ** -0.5)
    assert not torch.allclose(everything.float(), want[mid].float(), **TOL[dtype])


@pytest.mark.parametrize("window, softcap", [(20, None), (None, 1.5), (7, 2.0)], ids=["window", "softcap", "both"])
def test_extend_window_and_softcap(window, softcap):
    g = torch.Generator().manual_seed(5)
    page_size, pages = 16, 32
    k, v = make_pool(g, pages, page_size, 2, 64, torch.float32)
    q_lens, starts = [1, 80, 6], [30, 0, 100]
    table = make_table(g, [s + n for s, n in zip(starts, q_lens)], page_size, pages)
    cu_q, start = torch.tensor([0, 1, 81, 87]), torch.tensor(starts)
    q = query(g, 87, 4, 64, torch.float32, amp=3.0)
    opts = dict(window=window, softcap=softcap)
    got = ea.extend_attention(q, k, v, table, cu_q, start, page_size, 0.125, **opts)
    want = ea.extend_attention_reference(q, k, v, table, cu_q, start, page_size, 0.125, **opts)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    plain = ea.extend_attention_reference(q, k, v, table, cu_q, start, page_size, 0.125)
    assert (want - plain).abs().max() > 1e-2


def _decode_args():
    """Valid decode arguments: B 2, H 4, Hkv 2, D 16, 4 pages of 4."""
    return dict(q=torch.zeros(2, 4, 16), k=torch.zeros(16, 2, 16), v=torch.zeros(16, 2, 16),
                page_table=torch.tensor([[0, 1], [2, 3]]), kv_lens=torch.tensor([5, 8]), page_size=4, scale=0.25)


def _extend_args():
    return dict(q=torch.zeros(5, 4, 16), k=torch.zeros(16, 2, 16), v=torch.zeros(16, 2, 16),
                page_table=torch.tensor([[0, 1], [2, 3]]), cu_q=torch.tensor([0, 2, 5]), start_pos=torch.tensor([3, 0]),
                page_size=4, scale=0.25)


SHARED_BAD = [
    (dict(q=torch.zeros(2, 4, 16, dtype=torch.float64)), "float32/bfloat16"),
    (dict(k=torch.zeros(16, 2, 8), v=torch.zeros(16, 2, 8)), "head dims must match"),
    (dict(k=torch.zeros(16, 3, 16), v=torch.zeros(16, 3, 16)), "multiple of the KV heads"),
    (dict(v=torch.zeros(16, 2, 16, dtype=torch.bfloat16)), "one dtype and layout"),
    (dict(k=torch.zeros(16, 2, 16, dtype=torch.bfloat16), v=torch.zeros(16, 2, 16, dtype=torch.bfloat16)),
     "must be q's"),
    (dict(k=torch.zeros(16, 16, 2).transpose(1, 2), v=torch.zeros(16, 16, 2).transpose(1, 2)), "contiguous last dim"),
    (dict(page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)), "int32/int64"),
    (dict(page_size=3), "divide the pool"),
    (dict(scale=0.0), "must be > 0"),
    (dict(page_table=torch.tensor([[0, 1], [2, 4]])), "page ids must be in"),
    (dict(k=torch.zeros(16, 2, 16, device="meta"), v=torch.zeros(16, 2, 16, device="meta")), "move it first"),
]


@pytest.mark.parametrize("change, match", SHARED_BAD + [
    (dict(q=torch.zeros(3, 4, 16)), "must match"),
    (dict(kv_lens=torch.tensor([5.0, 8.0])), "kv_lens must be"),
    (dict(kv_lens=torch.tensor([5, 9])), r"kv_lens must be in \[0, 8\]"),
    (dict(kv_lens=torch.tensor([-1, 8])), r"kv_lens must be in"),
    (dict(num_splits=0), "num_splits"),
])
def test_decode_refuses_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        da.decode_attention(**{**_decode_args(), **change})


@pytest.mark.parametrize("change, match", SHARED_BAD[:-2] + [
    (dict(cu_q=torch.tensor([0, 2])), "cu_q must be"),
    (dict(cu_q=torch.tensor([0, 2, 5], device="meta")), "cu_q must be"),
    (dict(start_pos=torch.tensor([3])), "must match"),
    (dict(cu_q=torch.tensor([0, 2, 6])), "rise from 0"),
    (dict(cu_q=torch.tensor([0, 6, 5])), "rise from 0"),
    (dict(start_pos=torch.tensor([-1, 0])), "start_pos must be >= 0"),
    (dict(start_pos=torch.tensor([7, 0])), "start_pos \\+ q_len must be in"),
    (dict(page_table=torch.tensor([[0, 9], [2, 3]])), "page ids must be in"),
    (dict(window=0), "window >= 1"),
])
def test_extend_refuses_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        ea.extend_attention(**{**_extend_args(), **change})


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            da.decode_attention(**_decode_args())
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ea.extend_attention(**_extend_args())


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("qtype, kvtype", [("*bf16", "*bf16"), ("*fp32", "*fp32"), ("*bf16", "*fp8e4nv"),
                                           ("*fp16", "*fp8e5")])
def test_compiles_for_the_gpu(qtype, kvtype, tmp_path):
    """The interpreter runs the kernels as Python; the compiler is stricter. Each built for sm_90
    ahead of time, no GPU needed (triton ships ptxas), with every option on."""
    partial, reduce = da._kernels(False)
    extend = ea._kernel(False)
    types = {"q_ptr": qtype, "k_ptr": kvtype, "v_ptr": kvtype, "out_ptr": qtype, "table_ptr": "*i64",
             "lens_ptr": "*i32", "cu_ptr": "*i32", "start_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32",
             "acc_ptr": "*fp32", "qk_scale": "fp32", "kv_scale": "fp32", "softcap": "fp32"}
    common = {"BLOCK_N": 64, "BLOCK_D": 64, "USE_WINDOW": True, "USE_SOFTCAP": True, "FP8": "fp8" in kvtype,
              "UPCAST": False, "PRECISION": "ieee" if qtype == "*fp32" else "tf32"}
    builds = [(partial, {**common, "BLOCK_H": 16, "ONE_SPLIT": False}), (extend, {**common, "BLOCK_M": 64})]
    if qtype == "*bf16" and kvtype == "*bf16":
        builds += [(partial, {**common, "BLOCK_H": 16, "ONE_SPLIT": True}), (reduce, {"BLOCK_S": 8, "BLOCK_D": 64})]
    for fn, constexprs in builds:
        compiled = compile_for_sm90(fn, types, constexprs, tmp_path)
        assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_compiled_kernels_on_cuda(kv_dtype):
    """Both kernels compiled on the GPU, bf16 queries, long contexts (split-K on), page size 16, GQA 4."""
    g = torch.Generator().manual_seed(13)
    page_size, pages, h, hkv, d = 16, 2048, 32, 8, 128
    k, v = make_pool(g, pages, page_size, hkv, d, kv_dtype)
    lens = [1, 700, 4000, 9000]
    table = make_table(g, lens, page_size, pages)
    q, kv_lens = query(g, 4, h, d, torch.bfloat16), torch.tensor(lens)
    want = da.decode_attention_reference(q, k, v, table, kv_lens, page_size, d ** -0.5)
    q_lens, starts = [1, 300, 77, 1], [0, 0, 3000, 8999]
    qe, cu_q, start = query(g, 379, h, d, torch.bfloat16), torch.tensor([0, 1, 301, 378, 379]), torch.tensor(starts)
    want_e = ea.extend_attention_reference(qe, k, v, table, cu_q, start, page_size, d ** -0.5)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        dev = [t.cuda() for t in (q, k, v, table, kv_lens, qe, cu_q, start)]
        got = da.decode_attention(*dev[:5], page_size, d ** -0.5, max_kv_len=9000)
        got_e = ea.extend_attention(dev[5], dev[1], dev[2], dev[3], dev[6], dev[7], page_size, d ** -0.5, max_q_len=300)
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(got_e.cpu(), want_e, **TOL[torch.bfloat16])
