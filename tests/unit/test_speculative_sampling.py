"""Speculation keeps plain sampling's output distribution (issue 18), on a random tiny Llama with a
16-token vocabulary: the tokens sampled with n-gram drafts on (seeds 0..N-1) and off (other
seeds N..2N-1) pass a two-sample chi-square test at every output position; and at the same
seed the outputs are identical (the verify item draws the very sample plain decoding draws).
The prompt repeats a pattern so that the drafter proposes, and the model's peaked but not
one-hot distribution accepts some drafts and rejects others."""
from __future__ import annotations

import gc

import pytest
import torch
from scipy.stats import chi2_contingency

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.tokenizer.text_tokenizer import load_tokenizer
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from tests.unit.tiny_models import word_tokenizer

VOCAB = 16
N = 400
NEW = 6
PROMPT = [3, 7, 5, 9, 3, 7, 5, 9, 3, 7, 5, 9, 3, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.35, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("tiny16"))
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(path, VOCAB)
    return load_checkpoint(path), load_tokenizer(path)


def engine(tiny, spec: bool) -> Engine:
    checkpoint, tokenizer = tiny
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=64,
                          speculative_algorithm="NGRAM" if spec else None, speculative_num_draft_tokens=4,
                          speculative_ngram_min_match_window_size=1)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=64, speculative_cost_model="fixed",
                                                       speculative_row_cost=1e-6, speculative_disable_batch_size=1000),
                  checkpoint=checkpoint, tokenizer=tokenizer)


def sample(e: Engine, seeds: range, batched: bool = True) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=NEW, ignore_eos=True) for s in seeds]
    if batched:
        return [o.token_ids for o in e.generate_batch([PROMPT] * len(params), params)]
    return [e.generate_batch([PROMPT], p)[0].token_ids for p in params]


@pytest.fixture(scope="module")
def runs(tiny):
    out = {}
    for spec in (True, False):
        e = engine(tiny, spec)
        try:
            out[spec] = {"dist": sample(e, range(N) if spec else range(N, 2 * N)),
                         "same_seed": sample(e, range(40), batched=False),
                         "stats": e.scheduler.stats}
        finally:
            e.shutdown()
            gc.collect()
    return out


def test_drafts_were_both_accepted_and_rejected(runs):
    s = runs[True]["stats"]
    assert s.spec_verify_items > 20
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert runs[False]["stats"].spec_verify_items == 0


def test_the_same_seed_gives_the_same_tokens(runs):
    assert runs[True]["same_seed"] == runs[False]["same_seed"]


@pytest.mark.parametrize("position", range(NEW))
def test_each_positions_distribution_matches_plain_sampling(runs, position):
    spec = [t[position] for t in runs[True]["dist"]]
    plain = [t[position] for t in runs[False]["dist"]]
    counts = [[seq.count(v) for v in range(VOCAB)] for seq in (spec, plain)]
    kept = [v for v in range(VOCAB) if counts[0][v] + counts[1][v] >= 10]  # chi-square needs expected counts
    table = [[row[v] for v in kept] + [sum(row[v] for v in range(VOCAB) if v not in kept)] for row in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 2, table  # the distribution is not degenerate
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, (position, p, table)
