"""radixmesh bench's workloads: lengths, structure, seeded reproducibility; arrivals; the config."""
from __future__ import annotations

import math

import pytest

from services.loadgen.arrivals import arrival_times
from services.loadgen.config import BenchConfig, parse_slo
from services.loadgen.datasets import build_dataset, load_length_pairs
from services.loadgen.words import FALLBACK_WORDS, WordPool, pool_from_tokenizer

POOL = WordPool(tuple(FALLBACK_WORDS), False, "none")


def cfg(**kw) -> BenchConfig:
    return BenchConfig(progress=False, **kw)


def test_random_lengths_lie_in_the_range_and_the_seed_fixes_everything():
    c = cfg(dataset="random", num_prompts=200, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    convs = build_dataset(c, POOL)
    assert len(convs) == 200 and all(len(x.turns) == 1 and not x.chat for x in convs)
    turns = [x.turns[0] for x in convs]
    assert all(50 <= t.input_len <= 100 and 20 <= t.output_len <= 40 for t in turns)
    assert all(len(t.text.split()) == t.input_len for t in turns)
    assert len({t.input_len for t in turns}) > 10  # a spread, not one length
    assert build_dataset(c, POOL) == convs
    assert build_dataset(cfg(dataset="random", num_prompts=200, input_len=100, output_len=40, range_ratio=0.5,
                             seed=4), POOL) != convs
    fixed = build_dataset(cfg(dataset="random", num_prompts=5, input_len=7, output_len=3), POOL)
    assert {(x.turns[0].input_len, x.turns[0].output_len) for x in fixed} == {(7, 3)}


def test_word_pool_counts_are_exact_under_the_default_models_tokenizer(tokenizer):
    raw = tokenizer.raw
    vocab = [raw.id_to_token(i) or "" for i in range(raw.get_vocab_size())]
    pool = pool_from_tokenizer(lambda s: tokenizer.encode(s, add_special_tokens=False), vocab, "default")
    assert pool.exact and len(pool.words) >= 1000
    c = cfg(dataset="generated-shared-prefix", gsp_groups=2, gsp_prompts_per_group=3, gsp_system_prompt_len=300,
            gsp_question_len=17)
    for conv in build_dataset(c, pool):
        assert len(tokenizer.encode(conv.turns[0].text, add_special_tokens=False)) == 317 == conv.turns[0].input_len


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    c = cfg(dataset="generated-shared-prefix", gsp_groups=3, gsp_prompts_per_group=4, gsp_system_prompt_len=50,
            gsp_question_len=6, output_len=9)
    convs = build_dataset(c, POOL)
    assert [x.group for x in convs] == [g for g in range(3) for _ in range(4)]  # group-major order
    words = [x.turns[0].text.split() for x in convs]
    assert all(len(w) == 56 and x.turns[0].output_len == 9 for w, x in zip(words, convs))
    prefixes = [tuple(w[:50]) for w in words]
    for g in range(3):
        assert len(set(prefixes[4 * g: 4 * g + 4])) == 1
        assert len({tuple(w[50:]) for w in words[4 * g: 4 * g + 4]}) == 4  # distinct questions
    assert len(set(prefixes)) == 3


def test_multi_turn_conversations_are_chats_with_the_asked_turns():
    c = cfg(dataset="multi-turn", num_prompts=5, turns=3, input_len=12, output_len=6, range_ratio=0.5)
    convs = build_dataset(c, POOL)
    assert len(convs) == 5 and all(x.chat and len(x.turns) == 3 for x in convs)
    assert all(6 <= t.input_len <= 12 and 3 <= t.output_len <= 6 for x in convs for t in x.turns)
    assert build_dataset(c, POOL) == convs


def test_sharegpt_like_draws_pairs_from_the_bundled_file():
    pairs = set(load_length_pairs(None))
    assert len(pairs) > 100
    convs = build_dataset(cfg(dataset="sharegpt-like", num_prompts=50, seed=1), POOL)
    assert len(convs) == 50
    assert all((x.turns[0].input_len, x.turns[0].output_len) in pairs for x in convs)
    assert len(build_dataset(cfg(dataset="sharegpt-like", num_prompts=2000), POOL)) == 2000  # with replacement


def test_poisson_arrivals_have_the_asked_mean_rate_and_are_seeded():
    times = arrival_times(20000, 5.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.03)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(g < 0.2 for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.02)  # exponential
    assert arrival_times(10, 5.0, seed=7) == times[:10] and arrival_times(10, 5.0, seed=8) != times[:10]
    assert arrival_times(4, math.inf, seed=0) == [0.0] * 4 and arrival_times(0, 1.0, 0) == []


def test_config_validation_and_slo_parsing():
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0} and parse_slo(None) == {}
    for bad, message in (("ttft=5", "--slo takes METRIC:MS pairs .* got 'ttft=5'"),
                         ("foo:5", "--slo takes METRIC:MS pairs .* got 'foo:5'"),
                         ("ttft:x", "--slo ttft: 'x' is not a number of milliseconds"),
                         ("ttft:-1", "--slo ttft must be > 0 ms, got -1")):
        with pytest.raises(ValueError, match=message):
            parse_slo(bad)
    for kw, message in (({"range_ratio": 0.0}, r"--range-ratio must be in \(0, 1\], got 0.0"),
                        ({"request_rate": 0.0}, "--request-rate must be > 0"),
                        ({"max_concurrency": 0}, "--max-concurrency must be >= 1 or none, got 0"),
                        ({"num_prompts": 0}, "--num-prompts must be >= 1, got 0"),
                        ({"extra_body": "[1]"}, r"--extra-body must be a JSON object, got '\[1\]'"),
                        ({"base_url": "localhost:8000"}, "--base-url must start with http:// or https://"),
                        ({"slo": "tpot"}, "--slo takes METRIC:MS pairs .* got 'tpot'")):
        with pytest.raises(ValueError, match=message):
            cfg(**kw)
    assert cfg(extra_body='{"min_tokens": 4}').extra == {"min_tokens": 4}


def test_flags_come_from_the_config(capsys):
    from services.common.config import parse_config
    c = parse_config(BenchConfig, ["--dataset", "multi-turn", "--request-rate", "2.5", "--max-concurrency", "8",
                                   "--ignore-eos", "--slo", "ttft:100", "--no-progress"])
    assert (c.dataset, c.request_rate, c.max_concurrency, c.ignore_eos, c.progress) == \
        ("multi-turn", 2.5, 8, True, False)
    assert math.isinf(parse_config(BenchConfig, []).request_rate)
    with pytest.raises(SystemExit) as exit_:
        parse_config(BenchConfig, ["--slo", "bogus:1"])
    assert exit_.value.code == 2 and "--slo takes METRIC:MS pairs" in capsys.readouterr().err
