"""The Triton grammar-bitmask kernel (kernels/triton/grammar_bitmask.py) against its torch
reference and xgrammar's own kernel, on CPU, under Triton's interpreter.

How the interpreter is turned on in a shared pytest process: triton 3.9 reads
`triton.knobs.runtime.interpret` (TRITON_INTERPRET) when `triton.jit` decorates a function, not
when triton is imported nor when the kernel runs, so setting the env var before importing triton
is neither needed nor enough once another test file has imported it. The module decorates
lazily, one kernel per setting (`_kernel(interpret)`, with the knob pinned while decorating),
and the wrapper picks by the knob's value at the call. This file sets the knob in a module
fixture (`knobs.runtime.scope()` restores it and the env var after), so it works whatever ran
before it; `test_the_interpreter_is_chosen_per_call` checks exactly that. The compiled path is
checked without a GPU by compiling it ahead of time for sm_90 (`test_compiles_for_the_gpu`).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import xgrammar as xgr

from kernels.triton import grammar_bitmask as gb
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped

B = 5


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def random_bitmask(rows: int, vocab: int, seed: int, words: int | None = None) -> torch.Tensor:
    """[rows, W] int32 (W = ceil(V / 32) unless given) with all-zero, all-one and mixed words;
    in every row token 0 is forbidden and token 1 allowed, so every row masks something."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, words or (vocab + 31) // 32)
    out = torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64)
    kind = torch.randint(0, 3, shape, generator=g)
    out[kind == 0], out[kind == 1] = 0, -1
    out[:, 0] = (out[:, 0] & ~1) | 2
    return out.to(torch.int32)


def three_ways(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]):
    """(kernel, reference, xgrammar) outputs on copies of logits."""
    ours, ref, theirs = logits.clone(), logits.clone(), logits.clone()
    gb.apply_token_bitmask_(ours, bitmask, rows)
    gb.apply_token_bitmask_reference(ref, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    return ours, ref, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [], [1, 3], [4, 0, 2]], ids=["all", "none", "some", "unsorted"])
def test_kernel_equals_the_reference_and_xgrammar(dtype, vocab, rows):
    bitmask = random_bitmask(B, vocab, seed=vocab)
    logits = torch.randn(B, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    ours, ref, theirs = three_ways(logits, bitmask, rows)
    assert torch.equal(ours, ref)
    if vocab > 1:  # xgrammar 0.2.9 masks the wrong rows of a [B, 1] logits tensor
        assert torch.equal(ours, theirs)
    untouched = [b for b in range(B) if b not in rows]
    assert torch.equal(ours[untouched], logits[untouched])
    assert torch.isinf(ours[rows, 0]).all()
    if vocab > 1:
        assert not torch.isinf(ours[rows, 1]).any()


@pytest.mark.parametrize("fill, masked", [(0, True), (-1, False)], ids=["all-zero", "all-one"])
@pytest.mark.parametrize("vocab", [33, 1000])
def test_uniform_masks(fill, masked, vocab):
    logits = torch.randn(B, vocab).to(torch.bfloat16)
    bitmask = torch.full((B, (vocab + 31) // 32), fill, dtype=torch.int32)
    ours, ref, theirs = three_ways(logits, bitmask, [3, 1])
    assert torch.equal(ours, ref) and torch.equal(ours, theirs)
    assert torch.isinf(ours[[3, 1]]).all() == masked and not torch.isinf(ours[[0, 2, 4]]).any()


def test_strided_rows_and_a_bitmask_wider_than_the_vocabulary():
    wide = torch.randn(4, 1100, dtype=torch.float16)
    logits = wide[:, :1000]  # [4, 1000], row stride 1100
    bitmask = random_bitmask(4, 1000, seed=3, words=40)  # covers 1280 tokens
    bitmask[:, 31:] = 0  # bits 992..1279: 992..999 are real tokens, 1000.. lie past V and are ignored
    before = wide.clone()
    expected, theirs = logits.clone(), logits.clone()
    gb.apply_token_bitmask_reference(expected, bitmask, [2, 0])
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[2, 0])
    gb.apply_token_bitmask_(logits, bitmask, [2, 0])
    assert torch.equal(logits, expected) and torch.equal(logits, theirs)
    assert torch.equal(wide[:, 1000:], before[:, 1000:])  # nothing written past each row's V
    assert torch.isinf(wide[[0, 2], 992:1000]).all()


def test_a_strided_bitmask():
    logits = torch.randn(3, 100)
    bitmask = random_bitmask(3, 200, seed=5)[:, :4]  # [3, 4], row stride 7
    ours, ref = logits.clone(), logits.clone()
    gb.apply_token_bitmask_(ours, bitmask, [0, 1, 2])
    gb.apply_token_bitmask_reference(ref, bitmask, [0, 1, 2])
    assert torch.equal(ours, ref)


def test_logits_wider_than_the_bitmask_are_refused_where_xgrammar_leaves_them_unmasked():
    """Vocabulary padding: the worker sizes the bitmask to the logits' width, so a narrower one is
    a bug; xgrammar would let the uncovered (padded) ids be sampled."""
    logits, bitmask = torch.randn(2, 40), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="covers 32 tokens, logits have 40"):
        gb.apply_token_bitmask_(logits.clone(), bitmask, [0])
    with pytest.raises(ValueError, match="covers 32 tokens"):
        gb.apply_token_bitmask_reference(logits.clone(), bitmask, [0])
    theirs = logits.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0])
    assert torch.isinf(theirs[0, :32]).all() and torch.equal(theirs[0, 32:], logits[0, 32:])


@pytest.mark.parametrize("logits, bitmask, rows, match", [
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), [0], "int32"),
    (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), [0], "3 rows, logits 2"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [0, 2], r"rows \[2\] out of range"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [-1], "out of range"),
    (torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32), [0], "float32/bfloat16"),
    (torch.zeros(64, 2).t(), torch.zeros(2, 2, dtype=torch.int32), [0], "contiguous last dim"),
    (torch.zeros(64), torch.zeros(2, 2, dtype=torch.int32), [0], r"\[B, V\]"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), [0], "move it first"),
], ids=["bitmask-dtype", "batch", "row-past-end", "row-negative", "logits-dtype", "logits-stride", "logits-1d",
        "device"])
def test_bad_inputs_are_refused_by_both(logits, bitmask, rows, match):
    for apply in (gb.apply_token_bitmask_, gb.apply_token_bitmask_reference):
        with pytest.raises(ValueError, match=match):
            apply(logits, bitmask, rows)


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            gb.apply_token_bitmask_(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), [0])


def test_the_interpreter_is_chosen_per_call():
    """gb was imported (and maybe triton by other files) before the fixture set the knob."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(gb._kernel(True), InterpretedFunction)
    assert isinstance(gb._kernel(False), JITFunction)
    assert triton.knobs.runtime.interpret  # decorating the compiled kernel left the knob alone


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*fp32", "*bf16", "*fp16"])
def test_compiles_for_the_gpu(dtype, tmp_path):
    """The interpreter runs the kernel as Python; the compiler is stricter. Built for sm_90 ahead
    of time, no GPU needed (triton ships ptxas)."""
    signature = {"logits_ptr": dtype, "logits_stride": "i64", "bitmask_ptr": "*i32", "bitmask_stride": "i64",
                 "rows_ptr": "*i32", "vocab": "i32", "BLOCK_WORDS": "constexpr"}
    compiled = compile_for_sm90(gb._kernel(False), signature, {"BLOCK_WORDS": 64}, tmp_path)
    assert compiled.asm["cubin"]


def test_the_comparisons_catch_broken_kernels():
    """Not tautological: the reference and xgrammar are independent and agree on random inputs,
    and on this file's inputs each plausible kernel bug gives a different result."""
    bitmask, rows = random_bitmask(B, 1000, seed=9), [4, 0, 2]
    logits = torch.randn(B, 1000)

    def masked(bm: torch.Tensor, rs: list[int] = rows, width: int = 1000) -> torch.Tensor:
        out = logits.clone()
        gb.apply_token_bitmask_reference(out[:, :width], bm, rs)
        return out

    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    good = masked(bitmask)
    assert torch.equal(good, theirs)
    reversed_bits = sum(((bitmask >> j) & 1) << (31 - j) for j in range(32)).to(torch.int32)
    bugs = {
        "bits read most significant first": masked(reversed_bits),
        "the bit test inverted": masked(~bitmask),
        "the next row's words": masked(bitmask.roll(1, dims=0)),
        "words off by one": masked(bitmask.roll(1, dims=1)),
        "unlisted rows masked too": masked(bitmask, list(range(B))),
        "the last partial word skipped": masked(bitmask, width=992),
    }
    for bug, out in bugs.items():
        assert not torch.equal(out, good), bug


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_backend_masks_cuda_logits_with_the_compiled_kernel():
    from services.common.grammar.xgrammar_backend import XGrammarBackend

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        logits = torch.randn(8, 49152, device="cuda", dtype=torch.bfloat16)
        bitmask = random_bitmask(8, 49152, seed=1)  # on CPU, as new_bitmask allocates it
        expected = logits.clone()
        gb.apply_token_bitmask_reference(expected, bitmask.cuda(), [7, 2, 3])
        XGrammarBackend().apply_bitmask(logits, bitmask, [7, 2, 3])
        assert torch.equal(logits, expected)
