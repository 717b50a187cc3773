"""Batched sampler: greedy equivalences, seeded reproducibility, distribution fit
(chi-square against textbook definitions), penalties, suppression, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.common.sampling_params import SamplingParams as SP
from services.worker import sampling
from services.worker.sampling import (SamplingBatch, _candidates, apply_penalties,
                                      counter_uniform, pad_token_lists, sample, token_logprobs)

SMALL = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]  # V=8, no ties


def build(params: list[SP], seeds: list[int] | None = None, indices: list[int] | None = None,
          suppress: list[list[int]] | None = None, vocab: int = 8) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds if seeds is not None else list(range(n)),
                               indices if indices is not None else [0] * n,
                               suppress if suppress is not None else [[] for _ in range(n)], vocab)


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


# ---- textbook references (float64 numpy, written from the definitions) ----

def ref_distribution(logits: list[float], t: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                     min_p: float = 0.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / t
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), dtype=bool)
    keep[order[:top_k] if top_k > 0 else order] = True  # top_k: the k most likely
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1.0:  # smallest most-likely-first prefix with mass >= top_p
        cum = 0.0
        keep[:] = False
        for i in order:
            if p[i] == 0.0 or cum >= top_p:
                break
            keep[i] = True
            cum += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:  # drop tokens below min_p times the most likely one
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def draw_counts(logits: list[float], params: SP, n: int = 20000) -> np.ndarray:
    """n draws of one distribution in one batch: 4000 seeds x 5 sample indices."""
    v = len(logits)
    batch = build([params] * n, seeds=[1000 + i // 5 for i in range(n)],
                  indices=[i % 5 for i in range(n)], vocab=v)
    out = sample(torch.tensor([logits] * n, dtype=torch.float32), batch)
    return np.bincount(out.next_token_ids.numpy(), minlength=v)


@pytest.fixture
def small_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the top_p prefix so prefix, fallback and full paths run on a small vocab."""
    monkeypatch.setattr(sampling, "_TOP_P_PREFIX", 64)


# ---- greedy ----

def test_temperature_zero_is_argmax() -> None:
    logits = rand_logits(16, 500)
    out = sample(logits, build([SP(temperature=0.0)] * 16, vocab=500))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy_even_among_sampling_rows() -> None:
    logits = rand_logits(6, 500, seed=1)
    params = [SP(temperature=1.3, top_k=1), SP(temperature=1.0), SP(temperature=0.0),
              SP(temperature=0.7, top_k=1, top_p=0.5), SP(top_p=0.3), SP(top_k=1, min_p=0.2)]
    out = sample(logits, build(params, vocab=500))
    for b in (0, 2, 3, 5):
        assert out.next_token_ids[b] == logits[b].argmax()


def test_all_greedy_fast_path_equals_general_path() -> None:
    logits = rand_logits(8, 300, seed=2)
    greedy = [SP(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)] * 8
    prompt = pad_token_lists([[1, 2, 3], [4], [], [5, 5], [6], [7], [8], [9]])
    output = pad_token_lists([[int(logits[b].argmax())] for b in range(8)])
    suppress = [[int(logits[b].topk(2).indices[1])] for b in range(8)]
    fast = sample(logits, build(greedy, suppress=suppress, vocab=300), prompt, output)
    mixed = build(greedy + [SP(temperature=0.8)], suppress=suppress + [[]], vocab=300)
    assert not mixed.all_greedy
    general = sample(torch.cat([logits, logits[:1]]), mixed,
                     torch.cat([prompt, prompt[:1]]), torch.cat([output, output[:1]]))
    assert torch.equal(fast.next_token_ids, general.next_token_ids[:8])


# ---- seeded reproducibility ----

V_WIDE = 600  # with small_prefix: wider than the top_p prefix
CONFIGS = [SP(temperature=0.9), SP(temperature=0.8, top_k=40), SP(temperature=1.0, top_p=0.9),
           SP(temperature=0.7, min_p=0.05), SP(temperature=1.2, top_k=200, top_p=0.8, min_p=0.01)]
# Each mate set drives the batch down another path: a full sort (unfiltered and
# top_p mates), the unsorted full row (no top_p), the top_p prefix with fallback.
MATE_SETS = [
    [SP(temperature=0.0), SP(temperature=1.0), SP(top_p=0.5), SP(top_k=5),
     SP(top_k=500), SP(temperature=2.0, top_p=0.99), SP(min_p=0.3)],
    [SP(temperature=0.0), SP(temperature=1.0), SP(top_k=5), SP(min_p=0.3), SP(top_k=500)],
    [SP(top_p=0.9), SP(top_p=0.95, temperature=1.5), SP(top_k=5), SP(temperature=0.0)],
]


def run_row(row_logits: torch.Tensor, params: SP, seed: int, position: int,
            mates: list[SP], steps: int = 6) -> list[int]:
    """Sample `steps` tokens for one row placed at `position` among `mates`."""
    tokens = []
    for step in range(steps):
        params_list = list(mates)
        params_list.insert(position, params)
        seeds = [77 + 13 * i + step for i in range(len(mates))]
        seeds.insert(position, seed)
        indices = [step * 3 + i for i in range(len(mates))]  # mates' own counters
        indices.insert(position, step)
        logits = rand_logits(len(params_list), V_WIDE, seed=100 + step, scale=1.0)
        logits[1::2] *= 8.0  # mates mix flat rows (top_p fallback) with peaked ones
        logits[position] = row_logits + step * 0.01  # the row's own logits per step
        out = sample(logits, build(params_list, seeds, indices, vocab=V_WIDE))
        tokens.append(int(out.next_token_ids[position]))
    return tokens


@pytest.mark.parametrize("params", CONFIGS)
def test_same_seed_same_tokens_whatever_the_batch(params: SP, small_prefix: None) -> None:
    row = rand_logits(1, V_WIDE, seed=5, scale=4.0)[0]
    alone = run_row(row, params, seed=42, position=0, mates=[])
    for mates in MATE_SETS:
        assert run_row(row, params, seed=42, position=0, mates=mates) == alone
        assert run_row(row, params, seed=42, position=len(mates), mates=mates[::-1]) == alone
        assert run_row(row, params, seed=42, position=2, mates=mates[2:] + mates[:2]) == alone
    assert run_row(row, params, seed=43, position=0, mates=[]) != alone


def test_noise_is_a_pure_function_of_seed_index_and_token() -> None:
    seeds = torch.tensor([3, 3, 9], dtype=torch.int64)
    indices = torch.tensor([0, 1, 0], dtype=torch.int64)
    full = counter_uniform(seeds, indices, torch.arange(1000))  # [3, 1000]
    subset = torch.tensor([[5, 999, 0], [7, 7, 1], [500, 2, 3]])
    assert torch.equal(counter_uniform(seeds, indices, subset), full.gather(1, subset))
    assert 0.0 < float(full.min()) and float(full.max()) < 1.0
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[0], full[2])
    big = counter_uniform(torch.arange(200), torch.zeros(200, dtype=torch.int64), torch.arange(500))
    assert abs(float(big.mean()) - 0.5) < 0.005
    hist = np.histogram(big.numpy(), bins=20, range=(0, 1))[0]
    assert chisquare(hist).pvalue > 0.001


# ---- distributions ----

@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_p=0.8), dict(temperature=1.0, min_p=0.15),
    dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
])
def test_distribution_matches_textbook(kwargs: dict) -> None:
    params = SP(**kwargs)
    expected = ref_distribution(SMALL, kwargs["temperature"], params.top_k, params.top_p,
                                params.min_p)
    counts = draw_counts(SMALL, params)
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    assert chisquare(counts[kept], expected[kept] * counts.sum()).pvalue > 0.001


@pytest.mark.parametrize("kwargs", [dict(top_p=0.85), dict(top_k=4, min_p=0.1)])
def test_distribution_on_the_candidate_prefix_path(kwargs: dict, small_prefix: None) -> None:
    """V wider than the top_p prefix: the sampler works on the best K tokens only."""
    logits = SMALL + [-40.0] * (200 - len(SMALL))  # negligible tail, V > the prefix
    params = SP(**kwargs)
    assert build([params], vocab=200).candidate_width < 200
    expected = ref_distribution(logits, 1.0, params.top_k, params.top_p, params.min_p)
    counts = draw_counts(logits, params)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], expected[kept] * counts.sum()).pvalue > 0.001


@pytest.mark.parametrize("mate", [None, "flat_top_p", "unfiltered"])
def test_kept_sets_match_textbook_on_every_path(mate: str | None, small_prefix: None) -> None:
    """Peaked rows fit the top_p prefix and only their best K tokens get noise; a flat
    top_p mate forces the full-sort fallback; an unfiltered mate forces full-row noise."""
    params = [SP(top_p=0.9), SP(temperature=0.6, top_k=50, top_p=0.7), SP(top_k=7),
              SP(temperature=1.3, min_p=0.1, top_p=0.95), SP(top_k=100, min_p=0.02),
              SP(temperature=0.0, top_p=0.5)]
    logits = rand_logits(len(params), V_WIDE, seed=9, scale=5.0)
    if mate is not None:
        params.append(SP(top_p=0.9) if mate == "flat_top_p" else SP(temperature=0.9))
        logits = torch.cat([logits, rand_logits(1, V_WIDE, seed=10, scale=0.1)])
    batch = build(params, vocab=V_WIDE)
    assert batch.all_filtered == (mate != "unfiltered")
    vals, ids = _candidates(logits / batch.temperatures.clamp(min=1e-6)[:, None], batch)
    if ids is None:
        ids = torch.arange(V_WIDE).expand_as(vals)
    for b, p in enumerate(params):
        if p.is_greedy:
            continue
        kept = set(ids[b][vals[b] > float("-inf")].tolist())
        ref = ref_distribution(logits[b].tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        assert kept == set(np.flatnonzero(ref > 0).tolist()), f"row {b}"


# ---- penalties and suppression ----

def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]] * 2)
    prompt = pad_token_lists([[0, 1], [0, 1]])
    output = pad_token_lists([[2, 2, 3], [2, 2, 3]])
    out = apply_penalties(logits, prompt, output, repetition=torch.tensor([2.0, 1.0]),
                          frequency=torch.tensor([0.5, 0.0]), presence=torch.tensor([0.25, 0.0]))
    # seen = {0, 1, 2, 3}: positive / 2, negative * 2; then output counts {2: 2, 3: 1}
    # pay 0.5 * count + 0.25; prompt-only tokens 0 and 1 pay no frequency/presence.
    expected = torch.tensor([[1.0, -2.0, 0.25 - 1.25, -1.0 - 0.75, 1.0, 3.0],
                             [2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0]))


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    output = pad_token_lists([[1]])
    batch = build([SP(temperature=0.0, presence_penalty=1.0)], vocab=4)
    assert batch.any_penalties
    assert sample(logits, batch, None, output).next_token_ids.tolist() == [2]
    batch = build([SP(temperature=0.0, repetition_penalty=2.0)], vocab=4)
    assert sample(logits, batch, pad_token_lists([[1]]), None).next_token_ids.tolist() == [2]


def test_min_new_tokens_suppression_blocks_stop_ids() -> None:
    n = 2000
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 4.5, -1.0]] * n)
    stops = [0, 4]
    params = [SP(temperature=0.0)] + [SP(temperature=1.0)] * (n - 1)
    suppressed = sample(logits, build(params, suppress=[stops] * n, vocab=6))
    assert suppressed.next_token_ids[0] == 1  # greedy falls to the best allowed token
    assert not torch.isin(suppressed.next_token_ids, torch.tensor(stops)).any()
    free = sample(logits, build(params, vocab=6))
    assert free.next_token_ids[0] == 0
    assert torch.isin(free.next_token_ids, torch.tensor(stops)).any()


# ---- logprobs ----

def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = rand_logits(4, 200, seed=3)
    params = [SP(temperature=0.5, repetition_penalty=1.5), SP(temperature=0.0),
              SP(top_k=5), SP(top_p=0.5)]
    want = [3, -1, 0, 5]
    out = sample(logits, build(params, vocab=200), pad_token_lists([[1, 2]] * 4), None, want)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_token_ids[:, None])[:, 0])
    assert out.top_logprob_values.shape == (4, 5)
    assert (out.top_logprob_values[:, :-1] >= out.top_logprob_values[:, 1:]).all()
    torch.testing.assert_close(out.top_logprob_values, raw.gather(1, out.top_logprob_ids))
    assert torch.equal(out.top_logprob_ids[:, 0], logits.argmax(-1))
    rows = token_logprobs(out, want)
    assert rows[1] is None and rows[2].top == [] and len(rows[3].top) == 5
    assert rows[0].top[0] == (int(logits[0].argmax()), pytest.approx(float(raw[0].max())))


def test_no_logprobs_unless_asked() -> None:
    out = sample(rand_logits(2, 50), build([SP(), SP()], vocab=50), want_logprobs=[-1, -1])
    assert out.logprobs is None and out.top_logprob_ids is None
    assert token_logprobs(out, [-1, -1]) == [None, None]


def test_argmax_rows_is_torch_argmax_with_ties_infinities_nans_and_zeros():
    """Greedy decoding's argmax (a C++ op on CPU) must give torch.argmax's index exactly:
    the first maximum, NaN above everything, -inf rows, and +0 == -0."""
    from services.worker.sampling import argmax_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g)
    x[0] = float("-inf")
    x[1, 7] = x[1, 250] = 50.0  # a tie: the first wins
    x[2, 9], x[2, 3] = float("nan"), 99.0
    x[3, 299] = float("inf")
    x[4] = 0.0
    x[5] = -1.0
    x[5, 10], x[5, 20] = -0.0, 0.0
    x[6] = x[6].round()  # many ties
    x[7, 0], x[7, 5] = -float("nan"), 1e30
    x[8, 1::2] = float("-inf")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    big = torch.randn(64, 49152, generator=g)
    assert torch.equal(argmax_rows(big), big.argmax(dim=-1))


def test_run_sampler_takes_the_argmax_shortcut_only_when_nothing_else_applies() -> None:
    from dataclasses import dataclass, field

    from services.worker.sampler_inputs import run_sampler

    @dataclass
    class Req:
        sampling: SP
        prompt_ids: list = field(default_factory=lambda: [1, 2, 3])
        output_ids: list = field(default_factory=lambda: [4])
        seed: int = 7
        matcher: object = None

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    top = logits.argmax(-1).tolist()
    eos = (int(top[0]),)
    greedy = [Req(SP(temperature=0.0)) for _ in range(3)]
    tokens, lps = run_sampler(logits, greedy, ())
    assert tokens == top and lps == [None] * 3
    # Each of these changes the answer or its payload: the general path must run.
    banned = Req(SP(temperature=0.0, min_new_tokens=5))  # eos banned before 5 tokens
    assert run_sampler(logits[:1], [banned], eos)[0] != top[:1]
    penalized = Req(SP(temperature=0.0, repetition_penalty=1e9), prompt_ids=[top[0]])
    assert run_sampler(logits[:1], [penalized], ())[0] != top[:1]
    with_lp = Req(SP(temperature=0.0, logprobs=True))
    tokens, lps = run_sampler(logits[:1], [with_lp], ())
    assert tokens == top[:1] and lps[0] is not None


def test_ties_at_the_top_k_cut_stay_whatever_the_batch_mates() -> None:
    """[3, 2, 2, 2, 1, 0] with top_k 2: the cut falls inside a three-way tie, and all three stay.
    Alone (every row filtered, the K-candidate path) as with an unfiltered mate (the full row):
    the kept set, and so a seeded draw, must not depend on who shares the step."""
    row = [3.0, 2.0, 2.0, 2.0, 1.0, 0.0]
    kept_sets = []
    for mate in (None, SP(temperature=1.0)):
        params = [SP(temperature=1.0, top_k=2)] + ([mate] if mate else [])
        batch = build(params, vocab=6)
        assert batch.all_filtered == (mate is None)
        logits = torch.tensor([row] * len(params))
        vals, ids = _candidates(logits, batch)
        ids = torch.arange(6).expand_as(vals) if ids is None else ids
        kept_sets.append(set(ids[0][vals[0] > float("-inf")].tolist()))
    assert kept_sets == [{0, 1, 2, 3}, {0, 1, 2, 3}]


def test_a_greedy_mate_keeps_the_k_candidate_path() -> None:
    """Greedy rows do not filter: next to top_k rows without ties, the step still draws from the
    K candidates only (ids come back), not from the whole row."""
    batch = build([SP(temperature=0.0), SP(temperature=1.0, top_k=3), SP(temperature=0.7, top_k=2)], vocab=8)
    assert batch.all_filtered
    vals, ids = _candidates(torch.tensor([SMALL] * 3), batch)
    assert ids is not None and vals.shape == (3, 4)  # top_k + 1 candidates
    assert [int((v > float("-inf")).sum()) for v in vals[1:]] == [3, 2]
