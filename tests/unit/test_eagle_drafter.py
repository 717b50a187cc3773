"""EAGLE drafting changes no output (issue 39), on a random tiny Llama with a 16-token vocabulary and
random EAGLE-3 and EAGLE heads saved in SGLang's format: greedy output equals plain decoding's, for
chain drafts and tree drafts (verified under a tree mask, the accepted path's KV compacted); the
tokens sampled with tree drafts (seeds 0..N-1) and without (seeds N..2N-1) pass a two-sample
chi-square test at every output position, and at one seed the outputs are identical. Drafts were
both accepted and rejected along the way, and every request's head state and KV went back."""
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
from services.worker.speculative.eagle_head import EagleHead, EagleHeadConfig
from services.worker.speculative.tree import DraftTree
from tests.unit.tiny_models import word_tokenizer

VOCAB = 16
DRAFT_VOCAB = 12
LAYERS = 3
N = 300
NEW = 6
PROMPTS = [[3, 7, 5, 9, 3, 7, 5, 9, 3, 7], [1, 2, 3, 4, 5, 6], [11, 4, 11, 4, 11], [8, 8, 2, 9, 13, 6, 6, 1]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.35, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("tiny16"))
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(path, VOCAB)
    embed = model.model.embed_tokens.weight.detach()
    heads = {"EAGLE3": str(tmp_path_factory.mktemp("eagle3")), "EAGLE": str(tmp_path_factory.mktemp("eagle1"))}
    for name, out in heads.items():
        eagle3 = name == "EAGLE3"
        hc = EagleHeadConfig(eagle3=eagle3, hidden_size=64, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                             rope_theta=10000.0, max_position_embeddings=256, vocab_size=VOCAB,
                             draft_vocab_size=DRAFT_VOCAB if eagle3 else VOCAB, target_hidden_size=64,
                             capture_layers=(1, 2, 3) if eagle3 else (LAYERS,))
        head = EagleHead(hc, embed, None if eagle3 else model.lm_head.weight.detach(),
                         None if eagle3 else model.model.norm.weight.detach())
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.3)
        if eagle3:  # draft ids 0..11 name target ids 4..15
            head.d2t.fill_(VOCAB - DRAFT_VOCAB)
            head.t2d[VOCAB - DRAFT_VOCAB:] = True
        head.save(out, dtype=torch.float32)
    return load_checkpoint(path), load_tokenizer(path), heads


def engine(tiny, algorithm: str | None, topk: int = 1) -> Engine:
    checkpoint, tokenizer, heads = tiny
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=64,
                          speculative_algorithm=algorithm, speculative_draft_model_path=heads.get(algorithm),
                          speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=6)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=64, speculative_cost_model="fixed",
                                                       speculative_row_cost=1e-6, speculative_disable_batch_size=1000),
                  checkpoint=checkpoint, tokenizer=tokenizer)


def close(e: Engine) -> None:
    e.shutdown()
    gc.collect()


def generate(e: Engine, prompts: list[list[int]], params: list[SamplingParams], batched: bool) -> list[list[int]]:
    if batched:
        return [o.token_ids for o in e.generate_batch(prompts, params)]
    return [e.generate_batch([p], s)[0].token_ids for p, s in zip(prompts, params)]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny):
    e = engine(tiny, None)
    try:
        yield {"greedy": generate(e, PROMPTS, [GREEDY] * len(PROMPTS), batched=False),
               "dist": sampled(e, range(N, 2 * N)), "same_seed": sampled(e, range(30), batched=False)}
    finally:
        close(e)


def sampled(e: Engine, seeds: range, batched: bool = True) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=NEW, ignore_eos=True) for s in seeds]
    return generate(e, [PROMPTS[0]] * len(params), params, batched)


def check_released(e: Engine) -> None:
    e.scheduler.check_invariants()
    # the head keeps state for exactly the requests the runner holds (released ones went back)
    assert set(e.runner.drafter.streams) == set(e.runner.requests)


@pytest.mark.parametrize("algorithm,topk", [("EAGLE3", 1), ("EAGLE3", 3), ("EAGLE", 1), ("EAGLE", 2)],
                         ids=["eagle3-chain", "eagle3-tree", "eagle-chain", "eagle-tree"])
def test_greedy_equals_plain_one_at_a_time_and_batched(tiny, plain, algorithm, topk):
    e = engine(tiny, algorithm, topk)
    try:
        assert generate(e, PROMPTS, [GREEDY] * len(PROMPTS), batched=False) == plain["greedy"]
        assert generate(e, PROMPTS, [GREEDY] * len(PROMPTS), batched=True) == plain["greedy"]
        s = e.scheduler.stats
        assert s.spec_verify_items > 0 and s.spec_accepted_tokens > 0
        check_released(e)
    finally:
        close(e)


def record_trees(drafter) -> list[DraftTree]:
    """Wrap the drafter's propose to keep every tree it proposes → the list they land in."""
    trees: list[DraftTree] = []
    propose = drafter.propose

    def recording(batch, hidden=None):
        out = propose(batch, hidden)
        trees.extend(d for d in out if isinstance(d, DraftTree))
        return out

    drafter.propose = recording
    return trees


@pytest.fixture(scope="module")
def tree_runs(tiny):
    e = engine(tiny, "EAGLE3", topk=3)
    trees = record_trees(e.runner.drafter)
    try:
        yield {"dist": sampled(e, range(N)), "same_seed": sampled(e, range(30), batched=False),
               "stats": e.scheduler.stats, "trees": trees}
        check_released(e)
    finally:
        close(e)


def test_tree_drafts_branch_and_are_both_accepted_and_rejected(tree_runs):
    assert any(not t.is_chain() for t in tree_runs["trees"])
    s = tree_runs["stats"]
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens


def test_the_same_seed_gives_the_same_tokens_with_tree_drafts(tree_runs, plain):
    assert tree_runs["same_seed"] == plain["same_seed"]


@pytest.mark.parametrize("position", range(NEW))
def test_each_positions_distribution_matches_plain_sampling(tree_runs, plain, position):
    counts = [[0] * VOCAB, [0] * VOCAB]
    for k, outs in enumerate((tree_runs["dist"], plain["dist"])):
        for out in outs:
            counts[k][out[position]] += 1
    kept = [v for v in range(VOCAB) if counts[0][v] + counts[1][v] >= 10]  # chi-square needs expected counts
    assert len(kept) >= 2
    table = [[counts[k][v] for v in kept] for k in range(2)]
    assert chi2_contingency(table).pvalue > 0.001


def test_a_head_of_another_kind_or_target_is_refused_by_name(tiny):
    checkpoint, tokenizer, heads = tiny
    with pytest.raises(ValueError, match="EAGLE-3 head; use --speculative-algorithm EAGLE3"):
        Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, speculative_algorithm="EAGLE",
                                   speculative_draft_model_path=heads["EAGLE3"]),
               checkpoint=checkpoint, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, speculative_algorithm="EAGLE3"),
               checkpoint=checkpoint, tokenizer=tokenizer)


@pytest.mark.parametrize("flags,message", [
    ({"speculative_num_steps": 0}, "--speculative-num-steps"),
    ({"speculative_eagle_topk": 0}, "--speculative-eagle-topk"),
    ({"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens"),
    ({"tp_size": 2}, "--tp-size 1"),
])
def test_bad_eagle_flags_are_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(speculative_algorithm="EAGLE3", **flags)
