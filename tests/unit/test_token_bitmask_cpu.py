"""The CPU grammar-bitmask kernel (kernels/cpu/token_bitmask.cpp) against xgrammar's own kernel
and the torch reference beside it, and the greedy shortcut that skips the mask when a row's
raw argmax is allowed (services/worker/sampler_inputs.GrammarMask)."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kernels import token_bitmask_cpu
from services.common.grammar.xgrammar_backend import XGrammarBackend
from services.worker.sampler_inputs import GrammarMask


@pytest.fixture(scope="module")
def kernel():
    module = token_bitmask_cpu.load()
    assert module is not None, "the bitmask kernel must build wherever the other CPU kernels do"
    return module


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 with all-zero, all-one and mixed words."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    kind = torch.randint(0, 3, words.shape, generator=g)
    words[kind == 0], words[kind == 1] = 0, -1
    words[:, 0] = 0x2AAAAAAA  # token 0 forbidden, token 1 allowed, ...: every row masks something
    return words.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [], [3, 0], [4]], ids=["all", "none", "unsorted", "one"])
def test_kernel_equals_xgrammar_and_the_reference(kernel, dtype, vocab, rows):
    bitmask = random_bitmask(5, vocab, seed=vocab)
    logits = torch.randn(5, vocab).to(dtype)
    ours, theirs, ref = logits.clone(), logits.clone(), logits.clone()
    token_bitmask_cpu.apply_token_bitmask_(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    token_bitmask_cpu.apply_token_bitmask_reference(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    if vocab % 32 == 0 or len(rows) == 5:  # xgrammar 0.2.9 writes into unlisted rows otherwise
        assert torch.equal(ours, theirs)
    untouched = [b for b in range(5) if b not in rows]
    assert torch.equal(ours[untouched], logits[untouched])
    assert torch.isinf(ours[rows, 0]).all()


def test_strided_rows_and_bits_past_the_vocabulary(kernel):
    wide = torch.randn(4, 120)
    logits = wide[:, :100]  # row stride 120, the last dim contiguous
    bitmask = random_bitmask(4, 100, seed=7)
    bitmask[:, -1] = -1  # bits 96..127: 100..127 lie past V and must be ignored
    expected = logits.clone()
    token_bitmask_cpu.apply_token_bitmask_reference(expected, bitmask, [0, 2])
    token_bitmask_cpu.apply_token_bitmask_(logits, bitmask, [0, 2])
    assert torch.equal(logits, expected)
    assert torch.equal(wide[:, 100:], wide[:, 100:].clone())  # nothing written past each row's V


def test_kernel_refuses_bad_inputs(kernel):
    logits, bitmask = torch.randn(2, 64), torch.full((2, 2), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        kernel.apply_token_bitmask_(logits, bitmask.to(torch.int64), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="same rows"):
        kernel.apply_token_bitmask_(logits, bitmask[:1], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="cover"):
        kernel.apply_token_bitmask_(torch.randn(2, 65), bitmask, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.apply_token_bitmask_(logits, bitmask, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        kernel.apply_token_bitmask_(torch.randn(64, 2).t(), bitmask, torch.tensor([0]))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_repick_equals_argmax_of_the_masked_logits(seed):
    """Rows whose raw argmax is allowed keep it; the others take their masked argmax; rows
    without a grammar keep the raw argmax. Half the constrained rows are rigged each way."""
    g = torch.Generator().manual_seed(seed)
    B, V = 12, 3000
    logits = torch.randn(B, V, generator=g)
    bitmask = random_bitmask(B, V, seed)
    rows = [b for b in range(B) if b % 3 != 2]
    favourite = logits.argmax(-1)
    allowed = (bitmask[torch.arange(B), favourite >> 5] >> (favourite & 31)) & 1
    for i, b in enumerate(rows):  # make both cases occur: flip the favourite's bit where needed
        want = i % 2
        if allowed[b] != want:
            bitmask[b, favourite[b] >> 5] ^= torch.tensor(1 << (favourite[b].item() & 31), dtype=torch.int64).to(
                torch.int32)
    expected = logits.clone()
    token_bitmask_cpu.apply_token_bitmask_reference(expected, bitmask, rows)
    expected = expected.argmax(-1)
    kept = logits.clone()
    picked = logits.argmax(-1)
    GrammarMask(XGrammarBackend(), bitmask, rows).repick_greedy(logits, picked)
    assert torch.equal(picked, expected)
    assert torch.equal(logits, kept)  # the caller's logits are not masked in place
    assert (picked != favourite).sum() == len(rows) // 2  # exactly the refused rows changed
