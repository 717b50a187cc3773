"""The MLA (absorbed, latent KV) attention kernels against their torch references and against a
float64 loop written from the definition: the C++ decode kernel (kernels/mla_decode_cpu.py) and
the Triton decode/extend kernels (kernels/triton/mla_decode.py) under Triton's interpreter
(enabled per module with the knob, as tests/unit/test_triton_attention.py does). Latent rows of
Dk 48 (v_dim 32) and 576 (v_dim 512), 1/4/16/20 heads, ragged lengths, scattered slots and
pages, strided queries, float32/bfloat16/float16 and both FP8 pools. Small shapes: the
interpreter runs every program as numpy."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import mla_decode_cpu
from kernels.kv_fp8 import FP8_KV_SCALES
from kernels.triton import mla_decode as md
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}
SHAPES = [(48, 32), (576, 512)]  # (Dk, v_dim): a tiny config, DeepSeek-V3's 512 + 64
SHAPE_IDS = ["dk48", "dk576"]
HEADS = [1, 4, 16, 20]
# (pool dtype, query dtype)
CPU_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
             (E4M3, torch.bfloat16), (E5M2, torch.float32)]
TRITON_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (E4M3, torch.bfloat16),
                (E5M2, torch.float16)]


def case_id(case) -> str:
    return "-".join(str(t).removeprefix("torch.") for t in case)


@pytest.fixture(scope="module")
def kernel():
    module = mla_decode_cpu.load()
    assert module is not None, "the CPU kernel must build where a compiler is present (CI has one)"
    return module


@pytest.fixture(scope="module")
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def make_pool(g, slots: int, dk: int, dtype) -> torch.Tensor:
    """kv [slots, 1, Dk] of random rows; FP8 pools hold rounded values / scale, 1 in 16 bytes
    replaced by a random subnormal code (exponent bits 0)."""
    x = torch.randn(slots, 1, dk, generator=g)
    if dtype not in FP8_KV_SCALES:
        return x.to(dtype)
    raw = (x / FP8_KV_SCALES[dtype]).to(dtype).view(torch.uint8)
    sub = torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8) & (0x87 if dtype == E4M3 else 0x83)
    pick = torch.randint(0, 16, raw.shape, generator=g) == 0
    return torch.where(pick, sub, raw).view(dtype)


def query(g, rows: int, h: int, dk: int, dtype) -> torch.Tensor:
    """[rows, H, Dk], a strided view (the heads of a wider projection), as the model passes q."""
    return (torch.randn(rows, h + 2, dk, generator=g)).to(dtype)[:, 1:h + 1]


def scattered_slots(g, lens: list[int], pool: int) -> torch.Tensor:
    """[B, L] distinct random slots, padding past each length -1 (must never be read)."""
    perm = torch.randperm(pool, generator=g)
    slots = torch.full((len(lens), max(lens) + 3), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(lens):
        slots[b, :n] = perm[used:used + n]
        used += n
    return slots


def make_table(g, lens: list[int], page_size: int, pages: int) -> torch.Tensor:
    """[B, P] distinct random pages covering each length (padding -1: never read)."""
    need = [-(-n // page_size) for n in lens]
    perm = torch.randperm(pages, generator=g)
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    return table


def table_slots(table: torch.Tensor, n: int, page_size: int) -> list[int]:
    return [int(table[p // page_size]) * page_size + p % page_size for p in range(n)]


def naive(q: torch.Tensor, kv: torch.Tensor, slot_rows: list[list[int]], q_pos: list[int], scale: float,
          v_dim: int) -> torch.Tensor:
    """From the definition, float64: query row i at position q_pos[i] over the rows at
    slot_rows[i][0 .. q_pos[i]], each head's softmax by hand → [N, H, v_dim] float64."""
    ks = FP8_KV_SCALES.get(kv.dtype, 1.0)
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    for i, slots in enumerate(slot_rows):
        n = q_pos[i] + 1
        if n <= 0:
            continue
        rows = torch.stack([kv[s, 0].double() * ks for s in slots[:n]])  # [n, Dk]
        for h in range(q.shape[1]):
            scores = (rows @ q[i, h].double() * scale).tolist()
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, h] = sum(w * rows[j, :v_dim] for j, w in enumerate(weights)) / total
    return out


# ---- the C++ decode kernel ------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, q_dtype", CPU_CASES, ids=map(case_id, CPU_CASES))
@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("dk, v_dim", SHAPES, ids=SHAPE_IDS)
def test_cpu_decode(kernel, kv_dtype, q_dtype, h, dk, v_dim):
    g = torch.Generator().manual_seed(dk + h)
    lens = [1, 37, 80, 0]  # one key, ragged, none (a zero row)
    kv = make_pool(g, 300, dk, kv_dtype)
    slots, kv_lens, q = scattered_slots(g, lens, 300), torch.tensor(lens), query(g, len(lens), h, dk, q_dtype)
    scale = dk ** -0.5
    got = mla_decode_cpu.mla_decode_attention(q, kv, slots, kv_lens, scale, v_dim)
    want = mla_decode_cpu.reference(q, kv, slots, kv_lens, scale, v_dim)
    assert got.shape == (4, h, v_dim) and got.dtype == q_dtype
    torch.testing.assert_close(got, want, **TOL[q_dtype])
    slow = naive(q, kv, slots.tolist(), [n - 1 for n in lens], scale, v_dim)
    torch.testing.assert_close(got.double(), slow, **TOL[q_dtype])
    torch.testing.assert_close(want.double(), slow, **TOL[q_dtype])
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # not tautological: a kernel one key short would be told apart (the one-key request at least)
    short = mla_decode_cpu.reference(q, kv, slots, (kv_lens - 1).clamp(min=0), scale, v_dim)
    assert not torch.allclose(short[:3].float(), want[:3].float(), **TOL[q_dtype])


def test_cpu_heads_and_threads_do_not_change_a_result(kernel):
    """Each head's arithmetic is the same whatever block it lands in: one request alone (its heads
    split over the threads) equals its row of a batch, and 1 thread equals 2, bit for bit."""
    g = torch.Generator().manual_seed(7)
    dk, v_dim, h = 576, 512, 128
    lens = [50, 19, 33]
    kv = make_pool(g, 200, dk, torch.bfloat16)
    slots, kv_lens, q = scattered_slots(g, lens, 200), torch.tensor(lens), query(g, 3, h, dk, torch.bfloat16)
    batch = mla_decode_cpu.mla_decode_attention(q, kv, slots, kv_lens, 0.07, v_dim)
    alone = mla_decode_cpu.mla_decode_attention(q[1:2], kv, slots[1:2], kv_lens[1:2], 0.07, v_dim)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = mla_decode_cpu.mla_decode_attention(q, kv, slots, kv_lens, 0.07, v_dim)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batch[1]) and torch.equal(serial, batch)
    torch.testing.assert_close(batch, mla_decode_cpu.reference(q, kv, slots, kv_lens, 0.07, v_dim),
                               **TOL[torch.bfloat16])


def _cpu_args():
    return dict(q=torch.zeros(2, 4, 48), kv=torch.zeros(10, 1, 48), slots=torch.zeros(2, 3, dtype=torch.int64),
                kv_lens=torch.tensor([3, 1]), scale=0.1, v_dim=32)


@pytest.mark.parametrize("change, match", [
    (dict(kv=torch.zeros(10, 2, 48)), r"\[S, 1, Dk\]"),
    (dict(kv=torch.zeros(10, 1, 40)), "must match"),
    (dict(q=torch.zeros(2, 48)), r"\[B, H, Dk\]"),
    (dict(v_dim=49), "v_dim must be in"),
    (dict(v_dim=0), "v_dim must be in"),
    (dict(q=torch.zeros(2, 4, 48, dtype=torch.float64)), "float32/bfloat16/float16"),
    (dict(kv=torch.zeros(10, 1, 48, dtype=torch.int8)), "kv must be"),
    (dict(q=torch.zeros(2, 48, 4).transpose(1, 2)), "contiguous"),
    (dict(slots=torch.zeros(2, 3, dtype=torch.int32)), "slots must be"),
    (dict(slots=torch.zeros(3, 3, dtype=torch.int64)), "slots must be"),
    (dict(kv_lens=torch.tensor([3])), "kv_lens must be"),
    (dict(kv_lens=torch.tensor([4, 1])), r"not in \[0, L = 3\]"),
    (dict(kv_lens=torch.tensor([-1, 1])), r"not in \[0, L = 3\]"),
    (dict(slots=torch.tensor([[0, 1, 10], [0, 0, 0]])), r"slots\[0, 2\] = 10"),
])
def test_cpu_refuses_bad_inputs(kernel, change, match):
    with pytest.raises(RuntimeError, match=match):
        mla_decode_cpu.mla_decode_attention(**{**_cpu_args(), **change})


# ---- the Triton kernels, interpreted --------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, q_dtype", TRITON_CASES, ids=map(case_id, TRITON_CASES))
@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("dk, v_dim", SHAPES, ids=SHAPE_IDS)
def test_triton_decode(interpreter, kv_dtype, q_dtype, h, dk, v_dim):
    g = torch.Generator().manual_seed(dk * h)
    page_size = 16 if dk == 48 else 4
    lens = [1, 37, 80, 0]
    pages = 2 * 80 * 4 // page_size
    kv = make_pool(g, pages * page_size, dk, kv_dtype)
    table, kv_lens, q = make_table(g, lens, page_size, pages), torch.tensor(lens), query(g, 4, h, dk, q_dtype)
    scale = dk ** -0.5
    got = md.mla_decode_attention(q, kv, table, kv_lens, page_size, scale, v_dim)
    want = md.mla_decode_reference(q, kv, table, kv_lens, page_size, scale, v_dim)
    assert got.shape == (4, h, v_dim) and got.dtype == q_dtype
    torch.testing.assert_close(got, want, **TOL[q_dtype])
    slot_rows = [table_slots(table[b], n, page_size) for b, n in enumerate(lens)]
    slow = naive(q, kv, slot_rows, [n - 1 for n in lens], scale, v_dim)
    torch.testing.assert_close(got.double(), slow, **TOL[q_dtype])
    torch.testing.assert_close(want.double(), slow, **TOL[q_dtype])
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    short = md.mla_decode_reference(q, kv, table, (kv_lens - 1).clamp(min=0), page_size, scale, v_dim)
    assert not torch.allclose(short[:3].float(), want[:3].float(), **TOL[q_dtype])


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("dk, v_dim", SHAPES, ids=SHAPE_IDS)
def test_triton_decode_split_k(interpreter, splits, dk, v_dim):
    """Chunks of a request's keys, reduced, equal one pass; 5 splits of 3 keys leave chunks empty."""
    g = torch.Generator().manual_seed(splits + dk)
    lens, page_size, pages = [3, 90, 0], 8, 32
    kv = make_pool(g, pages * page_size, dk, torch.float32)
    table, kv_lens, q = make_table(g, lens, page_size, pages), torch.tensor(lens), query(g, 3, 20, dk, torch.float32)
    one = md.mla_decode_attention(q, kv, table, kv_lens, page_size, 0.1, v_dim, num_splits=1)
    many = md.mla_decode_attention(q, kv, table, kv_lens, page_size, 0.1, v_dim, num_splits=splits)
    torch.testing.assert_close(many, one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(many, md.mla_decode_reference(q, kv, table, kv_lens, page_size, 0.1, v_dim),
                               **TOL[torch.float32])


@pytest.mark.parametrize("kv_dtype, q_dtype", TRITON_CASES, ids=map(case_id, TRITON_CASES))
@pytest.mark.parametrize("h", [1, 20])
@pytest.mark.parametrize("dk, v_dim", SHAPES, ids=SHAPE_IDS)
def test_triton_extend(interpreter, kv_dtype, q_dtype, h, dk, v_dim):
    """A ragged batch: one query on an empty prefix, a prefill with no prefix, a chunk after a
    cached prefix, an empty item, a single token after a prefix."""
    g = torch.Generator().manual_seed(dk + h + 1)
    page_size = 4 if dk == 48 else 16
    q_lens, starts = [1, 12, 5, 0, 1], [0, 0, 41, 5, 30]
    lens = [s + n for s, n in zip(starts, q_lens)]
    pages = 2 * sum(lens) // page_size + 8
    kv = make_pool(g, pages * page_size, dk, kv_dtype)
    table = make_table(g, lens, page_size, pages)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q, start = query(g, sum(q_lens), h, dk, q_dtype), torch.tensor(starts)
    scale = dk ** -0.5
    got = md.mla_extend_attention(q, kv, table, cu_q, start, page_size, scale, v_dim)
    want = md.mla_extend_reference(q, kv, table, cu_q, start, page_size, scale, v_dim)
    assert got.shape == (sum(q_lens), h, v_dim) and got.dtype == q_dtype
    torch.testing.assert_close(got, want, **TOL[q_dtype])
    item = [i for i, n in enumerate(q_lens) for _ in range(n)]
    pos = [starts[i] + j for i, n in enumerate(q_lens) for j in range(n)]
    slot_rows = [table_slots(table[i], lens[i], page_size) for i in item]
    slow = naive(q, kv, slot_rows, pos, scale, v_dim)
    torch.testing.assert_close(got.double(), slow, **TOL[q_dtype])
    torch.testing.assert_close(want.double(), slow, **TOL[q_dtype])
    # not tautological: without the causal mask (each query seeing its item's last key) it differs
    everything = naive(q, kv, slot_rows, [lens[i] - 1 for i in item], scale, v_dim)
    prefill = slice(1, 12)  # the prefill's rows but its last
    assert not torch.allclose(everything[prefill], want[prefill].double(), **TOL[q_dtype])


def _decode_args():
    return dict(q=torch.zeros(2, 4, 48), kv=torch.zeros(16, 1, 48), page_table=torch.tensor([[0, 1], [2, 3]]),
                kv_lens=torch.tensor([5, 8]), page_size=4, scale=0.1, v_dim=32)


def _extend_args():
    return dict(q=torch.zeros(5, 4, 48), kv=torch.zeros(16, 1, 48), page_table=torch.tensor([[0, 1], [2, 3]]),
                cu_q=torch.tensor([0, 2, 5]), start_pos=torch.tensor([3, 0]), page_size=4, scale=0.1, v_dim=32)


SHARED_BAD = [
    (dict(q=torch.zeros(2, 4, 48, dtype=torch.float64)), "float32/bfloat16"),
    (dict(kv=torch.zeros(16, 2, 48)), r"\[S, 1, Dk"),
    (dict(kv=torch.zeros(16, 1, 40)), r"\[S, 1, Dk = 48\]"),
    (dict(kv=torch.zeros(16, 1, 48, dtype=torch.bfloat16)), "must be q's"),
    (dict(v_dim=0), "v_dim must be in"),
    (dict(v_dim=49), "v_dim must be in"),
    (dict(kv=torch.zeros(16, 1, 96)[..., ::2]), "contiguous last dim"),
    (dict(page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)), "int32/int64"),
    (dict(page_size=3), "divide the pool"),
    (dict(scale=0.0), "must be > 0"),
]


@pytest.mark.parametrize("change, match", SHARED_BAD + [
    (dict(q=torch.zeros(3, 4, 48)), "must match"),
    (dict(kv_lens=torch.tensor([5, 9])), r"kv_lens must be in \[0, 8\]"),
    (dict(page_table=torch.tensor([[0, 1], [2, 4]])), "page ids must be in"),
    (dict(num_splits=0), "num_splits"),
])
def test_triton_decode_refuses_bad_inputs(interpreter, change, match):
    with pytest.raises(ValueError, match=match):
        md.mla_decode_attention(**{**_decode_args(), **change})


@pytest.mark.parametrize("change, match", SHARED_BAD + [
    (dict(cu_q=torch.tensor([0, 2])), "cu_q must be"),
    (dict(cu_q=torch.tensor([0, 6, 5])), "rise from 0"),
    (dict(start_pos=torch.tensor([7, 0])), r"start_pos \+ q_len must be in"),
])
def test_triton_extend_refuses_bad_inputs(interpreter, change, match):
    with pytest.raises(ValueError, match=match):
        md.mla_extend_attention(**{**_extend_args(), **change})


def test_triton_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            md.mla_decode_attention(**_decode_args())
        with pytest.raises(ValueError, match="needs a CUDA device"):
            md.mla_extend_attention(**_extend_args())


@pytest.mark.slow  # ahead-of-time sm_90 compiles: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("qtype, kvtype", [("*bf16", "*bf16"), ("*fp16", "*fp8e5")])
def test_triton_compiles_for_the_gpu(qtype, kvtype, tmp_path):
    """The interpreter runs the kernels as Python; the compiler is stricter. DeepSeek's shape
    (v_dim 512, rope 64), built for sm_90 ahead of time, no GPU needed."""
    decode, extend = md._kernels(False)
    types = {"q_ptr": qtype, "kv_ptr": kvtype, "out_ptr": qtype, "table_ptr": "*i64", "lens_ptr": "*i32",
             "cu_ptr": "*i32", "start_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
             "qk_scale": "fp32", "kv_scale": "fp32"}
    common = {"BLOCK_N": 32, "BLOCK_V": 512, "BLOCK_R": 64, "FP8": "fp8" in kvtype, "UPCAST": False,
              "PRECISION": "tf32"}
    for fn, constexprs in [(decode, {**common, "BLOCK_H": 16, "ONE_SPLIT": False}),
                           (decode, {**common, "BLOCK_H": 16, "ONE_SPLIT": True}),
                           (extend, {**common, "BLOCK_M": 32})]:
        assert compile_for_sm90(fn, types, constexprs, tmp_path).asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, E4M3])
def test_triton_compiled_on_cuda(kv_dtype):
    """Both kernels compiled on the GPU: DeepSeek's shape, 128 heads, long contexts (split-K on)."""
    g = torch.Generator().manual_seed(13)
    dk, v_dim, h, page_size, pages = 576, 512, 128, 16, 1024
    kv = make_pool(g, pages * page_size, dk, kv_dtype)
    lens = [1, 700, 4000]
    table, kv_lens, q = make_table(g, lens, page_size, pages), torch.tensor(lens), query(g, 3, h, dk, torch.bfloat16)
    want = md.mla_decode_reference(q, kv, table, kv_lens, page_size, dk ** -0.5, v_dim)
    q_lens, starts = [1, 200, 30], [0, 0, 3000]
    qe, cu_q, start = query(g, 231, h, dk, torch.bfloat16), torch.tensor([0, 1, 201, 231]), torch.tensor(starts)
    want_e = md.mla_extend_reference(qe, kv, table, cu_q, start, page_size, dk ** -0.5, v_dim)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        dev = [t.cuda() for t in (q, kv, table, kv_lens, qe, cu_q, start)]
        got = md.mla_decode_attention(*dev[:4], page_size, dk ** -0.5, v_dim, max_kv_len=4000)
        got_e = md.mla_extend_attention(dev[4], dev[1], dev[2], dev[5], dev[6], page_size, dk ** -0.5, v_dim,
                                        max_q_len=200)
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(got_e.cpu(), want_e, **TOL[torch.bfloat16])
