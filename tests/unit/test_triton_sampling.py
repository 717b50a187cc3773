"""The Triton top-k/top-p/min-p sampling kernel (kernels/triton/sampling.py) against its torch
reference, the worker's CPU sampler (services/worker/sampling.py) and the textbook distribution,
on CPU, under Triton's interpreter (enabled per module with the knob, as
tests/unit/test_triton_bitmask.py explains). Small shapes: the interpreter runs every program as
numpy. Rows are tie-free (continuous random logits) except where ties are the point."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kernels.triton import sampling as ks
from services.common.sampling_params import SamplingParams as SP
from services.worker import sampling
from tests.unit.test_sampling import ref_distribution
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def random_params(n: int, vocab: int, seed: int) -> list[SP]:
    """Random top_k/top_p/min_p combinations, each filter often off, temperatures 0.5-1.5."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
    return [SP(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(pick([-1, 0, 2, 9, 60, vocab - 1, vocab + 5])),
               top_p=float(pick([1.0, 1.0, 0.99, 0.8, 0.4, 0.05])), min_p=float(pick([0.0, 0.0, 0.01, 0.1, 0.6, 1.0])))
            for _ in range(n)]


def random_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """[n, V] from flat (scale 0.3) to peaked (scale 8): top_p cuts land early and late."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-0.5, 0.9, n)[torch.randperm(n, generator=g)]
    return torch.randn(n, vocab, generator=g) * scale[:, None]


def cpu_kept(scaled: torch.Tensor, batch: sampling.SamplingBatch) -> torch.Tensor:
    """The tokens services/worker/sampling.py's filters keep, as a [B, V] mask."""
    vals, ids = sampling._candidates(scaled, batch)
    if ids is None:
        return torch.isfinite(vals)
    return torch.zeros(scaled.shape, dtype=torch.bool).scatter_(1, ids, torch.isfinite(vals))


def draw(probs, top_ks, top_ps, min_ps, seeds, indices):
    """(kernel, reference) draws of the same arguments."""
    args = (probs, top_ks, top_ps, min_ps, seeds, indices)
    return ks.sample_from_probs(*args), ks.sample_from_probs_reference(*args)


def test_the_noise_is_bit_identical_to_counter_uniform():
    """The uniforms the kernel's draw used, for every token of a 2-block row, whatever the seed."""
    seeds = torch.tensor([0, 1, -5, 2**62 + 3, -2**63, 12345], dtype=torch.int64)
    indices = torch.tensor([0, 7, 3, 2**40, 5, -1], dtype=torch.int64)
    probs = torch.rand(6, 700).softmax(-1)
    noise = torch.empty(6, 700)
    ks.sample_from_probs(probs, torch.full((6,), 5), torch.full((6,), 0.9), torch.zeros(6), seeds, indices,
                         noise_out=noise)
    want = sampling.counter_uniform(seeds, indices, torch.arange(700))
    assert torch.equal(noise, want)
    assert torch.equal(ks.counter_uniform_reference(seeds, indices, torch.arange(700)), want)


@pytest.mark.parametrize("vocab, seed", [(257, 1), (1100, 2)])
def test_kept_sets_and_tokens_equal_the_cpu_sampler(vocab, seed):
    """32 random rows and filter combinations (1100 > the CPU sampler's top_p prefix and > BLOCK):
    the kernel keeps sampling.py's set and draws sample()'s token, as does the reference."""
    params = random_params(32, vocab, seed)
    logits = random_logits(32, vocab, seed)
    batch = sampling.SamplingBatch.build(params, [100 + b for b in range(32)], [3 * b for b in range(32)],
                                         [[] for _ in params], vocab)
    scaled = logits / batch.temperatures[:, None]
    probs = scaled.softmax(-1)
    ours, ref = draw(probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.sample_indices)
    kept = probs >= ours.kept_min[:, None]
    assert torch.equal(kept, cpu_kept(scaled, batch))
    assert torch.equal(ours.kept_min, ref.kept_min)
    sizes = kept.sum(-1)
    assert (sizes < vocab).sum() > 20 and (sizes > 5).sum() > 5  # most rows filter, some keep many
    assert torch.equal(ours.token_ids, ref.token_ids)
    assert kept.gather(1, ours.token_ids[:, None]).all()
    assert torch.equal(ours.token_ids, sampling.sample(logits, batch).next_token_ids)
    assert torch.equal(sampling._draw_filtered_on_device(scaled, batch), ours.token_ids)  # sample()'s CUDA branch


def test_edge_rows_equal_the_reference():
    """k = 1, 0, -1, V, > V; top_p tiny and 1; min_p 1; suppressed (p = 0) tokens; a single
    nonzero token; rows strided in a wider tensor."""
    V = 40
    g = torch.Generator().manual_seed(7)
    wide = torch.zeros(9, V + 8)
    probs = wide[:, 3:3 + V]
    probs.copy_((torch.randn(9, V, generator=g) * 2).softmax(-1))
    probs[1, ::2] = 0.0
    probs[4] = 0.0
    probs[4, 17] = 1.0
    top_ks = torch.tensor([1, 0, -1, V, V + 3, 3, 39, 5, 38])
    top_ps = torch.tensor([1.0, 0.5, 1e-6, 0.3, 1.0, 1.0, 0.9, 0.7, 1.0])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.2, 0.0, 0.5, 0.0])
    seeds, indices = torch.arange(9), torch.arange(9) * 11
    ours, ref = draw(probs, top_ks, top_ps, min_ps, seeds, indices)
    assert torch.equal(ours.kept_min, ref.kept_min) and torch.equal(ours.token_ids, ref.token_ids)
    kept = probs >= ours.kept_min[:, None]
    assert kept[0].sum() == 1 and kept[2].sum() == 1 and kept[4].sum() == 1  # k = 1, tiny top_p, min_p 1
    assert ours.token_ids[0] == probs[0].argmax() and ours.token_ids[4] == 17
    assert kept[8].sum() == 38 and not kept[1].all()
    assert (probs.gather(1, ours.token_ids[:, None]) > 0).all()  # a zero-probability token never drawn
    assert torch.equal(wide[:, :3], torch.zeros(9, 3)) and torch.equal(wide[:, 3 + V:], torch.zeros(9, 5))


@pytest.mark.slow  # a chi-square over ~1000 interpreted draws
@pytest.mark.parametrize("kwargs, n", [(dict(top_k=4, top_p=0.8), 800), (dict(top_p=0.9, min_p=0.1), 1000)])
def test_draws_follow_the_renormalised_kept_probabilities(kwargs, n):
    """n sample indices of one row in one launch (the interpreter takes ~5-30 ms a row): the counts
    fit the textbook distribution (tests/unit/test_sampling.ref_distribution), no dropped token is
    ever drawn, and the test has the power to reject the kept set drawn uniformly."""
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0]
    params = SP(**kwargs)
    expected = ref_distribution(logits, 1.0, params.top_k, params.top_p, params.min_p)
    probs = torch.tensor(logits).softmax(-1)[None, :].expand(n, -1)  # row stride 0
    batch = sampling.SamplingBatch.build([params] * n, [42] * n, list(range(n)), [[] for _ in range(n)], 7)
    out = ks.sample_from_probs(probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.sample_indices)
    counts = np.bincount(out.token_ids.numpy(), minlength=7)
    kept = expected > 0
    assert 3 <= kept.sum() < 7 and counts[~kept].sum() == 0
    want = expected[kept] / expected[kept].sum() * n
    assert chisquare(counts[kept], want).pvalue > 1e-3
    assert chisquare(counts[kept], np.full(kept.sum(), n / kept.sum())).pvalue < 1e-6


@pytest.mark.parametrize("logits, params, want", [
    ([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], SP(top_k=2), {0, 1, 2, 3}),  # the k-th ties: all of them stay
    (np.log([0.4, 0.2, 0.2, 0.2]).tolist(), SP(top_p=0.5), {0, 1, 2, 3}),  # top_p cuts inside a tie group
    (np.log([0.3, 0.2, 0.2, 0.2, 0.1]).tolist(), SP(top_k=2, top_p=0.55), {0}),  # S = 0.5: exactly k tokens
    (np.log([0.3, 0.2, 0.2, 0.2, 0.1]).tolist(), SP(top_k=2, top_p=0.65), {0, 1, 2, 3}),
], ids=["top_k", "top_p", "top_k-mass", "top_k-mass-2"])
def test_ties_at_a_cut_stay_as_in_the_cpu_sampler(logits, params, want):
    """Equal logits give equal probabilities, so these ties are exact. The CPU sampler is run with an
    unfiltered mate: when every row filters it draws among the top-K ids only (K = the widest
    top_k), which drops the k-th's ties past K, against its own "ties at the cut stay"."""
    V = len(logits)
    batch = sampling.SamplingBatch.build([params, SP()], [5, 6], [0, 0], [[], []], V)
    assert not batch.all_filtered
    scaled = torch.tensor([logits, logits])
    probs = scaled.softmax(-1)
    ours, ref = draw(probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.sample_indices)
    kept = probs[0] >= ours.kept_min[0]
    assert set(torch.nonzero(kept).flatten().tolist()) == want
    assert torch.equal(kept, cpu_kept(scaled, batch)[0]) and torch.equal(ours.kept_min, ref.kept_min)
    assert torch.equal(ours.token_ids, ref.token_ids) and bool(kept[ours.token_ids[0]])


def test_min_p_keeps_a_token_exactly_at_its_cut():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.25, 0.0]])
    one = lambda x, dtype=torch.float32: torch.tensor([x], dtype=dtype)  # noqa: E731
    ours, ref = draw(probs, one(-1, torch.int64), one(1.0), one(0.5), one(0, torch.int64), one(0, torch.int64))
    assert ours.kept_min.item() == ref.kept_min.item() == 0.25 and ours.token_ids.item() in (0, 1, 3)


def _good():
    """Valid arguments for B = 2, V = 8."""
    return dict(probs=torch.full((2, 8), 0.125), top_ks=torch.tensor([2, -1]), top_ps=torch.tensor([1.0, 0.9]),
                min_ps=torch.zeros(2), seeds=torch.tensor([1, 2]), sample_indices=torch.tensor([0, 0]))


@pytest.mark.parametrize("change, match", [
    (dict(probs=torch.zeros(2, 8, dtype=torch.float64)), r"\[B, V\] float32"),
    (dict(probs=torch.zeros(8)), r"\[B, V\] float32"),
    (dict(probs=torch.zeros(8, 2).t()), "contiguous last dim"),
    (dict(top_ks=torch.tensor([2, -1], dtype=torch.int32)), "top_ks must be contiguous"),
    (dict(top_ps=torch.ones(3)), r"top_ps must be contiguous \[2\]"),
    (dict(min_ps=torch.zeros(4)[::2]), "min_ps must be contiguous"),
    (dict(seeds=torch.tensor([1.0, 2.0])), "seeds must be"),
    (dict(sample_indices=torch.tensor([0, 0], device="meta")), "move it first"),
], ids=["dtype", "1d", "stride", "top_k-dtype", "top_p-shape", "min_p-stride", "seed-dtype", "device"])
def test_bad_inputs_are_refused_by_both(change, match):
    for fn in (ks.sample_from_probs, ks.sample_from_probs_reference):
        with pytest.raises(ValueError, match=match):
            fn(**{**_good(), **change})


def test_bad_noise_out_and_cpu_tensors_without_the_interpreter():
    with pytest.raises(ValueError, match="noise_out must be"):
        ks.sample_from_probs(**_good(), noise_out=torch.empty(2, 7))
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ks.sample_from_probs(**_good())


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("write_noise", [False, True])
def test_compiles_for_the_gpu(write_noise, tmp_path):
    """The interpreter runs the kernel as Python; the compiler is stricter. Built for sm_90 ahead
    of time, no GPU needed (triton ships ptxas)."""
    from triton.runtime.jit import JITFunction

    if not isinstance(triton.language.standard._sum_combine, JITFunction):
        pytest.skip("TRITON_INTERPRET=1 at import: triton's own reduction helpers are interpreted")

    signature = {"probs_ptr": "*fp32", "probs_stride": "i64", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
                 "min_p_ptr": "*fp32", "seed_ptr": "*i64", "index_ptr": "*i64", "token_ptr": "*i64",
                 "kept_min_ptr": "*fp32", "noise_ptr": "*fp32", "vocab": "i32", "BLOCK": "constexpr",
                 "PIVOTS": "constexpr", "WRITE_NOISE": "constexpr"}
    constexprs = {"BLOCK": ks.BLOCK, "PIVOTS": ks.PIVOTS, "WRITE_NOISE": write_noise}
    compiled = compile_for_sm90(ks._kernel(False), signature, constexprs, tmp_path)
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_equals_the_cpu_sampler():
    """A real vocabulary on the compiled kernel: the reference's kept sets and tokens, and
    sample() on CUDA logits (the kernel branch) gives sample()'s CPU tokens. On flat rows a top_p
    cut falls among tokens of p ~ 1e-5 while float32 sums over 152k tokens err by ~1e-6, so kept
    sets may differ at the cut (only there); such a token wins a draw with odds ~1e-5."""
    V, B = 151936, 64
    params = random_params(B, V, seed=3)
    logits = random_logits(B, V, seed=3)
    seeds, indices = [7 * b for b in range(B)], [b % 5 for b in range(B)]
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        batch = sampling.SamplingBatch.build(params, seeds, indices, [[] for _ in params], V, device="cuda")
        probs = (logits.cuda() / batch.temperatures[:, None]).softmax(-1)
        ours = ks.sample_from_probs(probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds,
                                    batch.sample_indices)
        ref = ks.sample_from_probs_reference(probs, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds,
                                             batch.sample_indices)
        differ = (probs >= ours.kept_min[:, None]) != (probs >= ref.kept_min[:, None])
        near_cut = (probs - ref.kept_min[:, None]).abs() <= 1e-3 * ref.kept_min[:, None]
        assert not (differ & ~near_cut).any() and differ.sum() <= B
        assert torch.equal(ours.token_ids, ref.token_ids)
        on_gpu = sampling.sample(logits.cuda(), batch).next_token_ids.cpu()
    cpu_batch = sampling.SamplingBatch.build(params, seeds, indices, [[] for _ in params], V)
    assert torch.equal(on_gpu, sampling.sample(logits, cpu_batch).next_token_ids)
