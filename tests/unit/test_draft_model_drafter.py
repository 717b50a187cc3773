"""STANDALONE drafting with a draft model on its own paged KV: with the target's own checkpoint
as the draft, proposals are the target's greedy continuation, batched at different depths and
after a rejected draft (the rollback); released requests return their pages; a full pool or the
draft's context end gives no draft; a draft of another vocabulary is refused; and through the
Engine, greedy output is the same with and without speculation."""
from __future__ import annotations

import gc

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model_runner import ModelRunner
from services.worker.speculative.draft_model import DraftModelDrafter
from services.worker.speculative.drafter import DraftRequest
from tests.unit.tiny_models import greedy_continuation

PAGE = 4
BYTES_PER_PAGE = 2 * 2 * 2 * 16 * 4 * PAGE  # K and V, 2 layers, 2 KV heads of 16, float32


def save_llama(path, vocab_size: int = 256):
    """A random tiny float32 Llama (seed 0) saved as safetensors → (directory, transformers model)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("tiny_llama"))


def worker(path: str, draft_pages: int = 64, **kw) -> WorkerConfig:
    return WorkerConfig(dtype="float32", page_size=PAGE, kv_cache_bytes=1 << 20, max_requests=4,
                        speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                        speculative_draft_kv_cache_bytes=draft_pages * BYTES_PER_PAGE, **kw)


def drafter(path: str, draft_pages: int = 64, **kw) -> DraftModelDrafter:
    """The target's ModelRunner builds its drafter from the flags, as the worker does."""
    d = ModelRunner(worker(path, draft_pages, **kw), load_checkpoint(path)).drafter
    assert isinstance(d, DraftModelDrafter) and d.runner.kv_spec.num_pages == draft_pages
    return d


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_self_drafting_proposes_the_targets_greedy_continuation_batched_at_different_depths(tiny):
    path, hf = tiny
    d = drafter(path)
    seqs = dict(zip("abcd", prompts(10, 17, 5, 9)))
    for rid, s in seqs.items():
        d.admit(rid, s)
    depths = {"a": 4, "b": 1, "c": 6, "d": 0}
    got = d.propose([DraftRequest(rid, n) for rid, n in depths.items()])
    assert got == [greedy_continuation(hf, seqs[rid], n) for rid, n in depths.items()]
    d.check_invariants()


def test_after_a_rejected_draft_the_next_proposal_is_again_the_greedy_continuation(tiny):
    path, hf = tiny
    d = drafter(path)
    a, b = prompts(11, 6)
    d.admit("a", a)
    d.admit("b", b)
    draft_a, draft_b = d.propose([DraftRequest("a", 5), DraftRequest("b", 3)])
    # a: the target kept 2 draft tokens, then sampled another than the third; b: kept all 3 plus its own.
    a += draft_a[:2] + [(draft_a[2] + 1) % 256]
    b += draft_b + [(greedy_continuation(hf, b + draft_b, 1)[0] + 7) % 256]
    d.extend("a", a[11:])
    d.extend("b", b[6:])
    assert d.propose([DraftRequest("a", 4), DraftRequest("b", 5)]) == [
        greedy_continuation(hf, a, 4), greedy_continuation(hf, b, 5)]
    # a rejects the whole draft (its first token differs): the rollback reaches the true tokens.
    first = greedy_continuation(hf, a, 1)[0]
    a.append((first + 1) % 256)
    d.extend("a", a[-1:])
    assert d.propose([DraftRequest("a", 3)]) == [greedy_continuation(hf, a, 3)]
    d.check_invariants()


def test_released_requests_return_every_draft_page_and_their_rows(tiny):
    path, _ = tiny
    d = drafter(path)
    for rid, s in zip("abc", prompts(30, 13, 21)):
        d.admit(rid, s)
    d.propose([DraftRequest(rid, 5) for rid in "abc"])
    assert len(d.free_pages) < 64
    d.admit("b", prompts(7)[0])  # re-admitted (a retraction): its old pages return at once
    d.propose([DraftRequest("b", 2)])
    d.check_invariants()
    for rid in "abc":
        d.release(rid)
    d.release("never-admitted")
    assert sorted(d.free_pages) == list(range(64)) and not d.drafts and not d.runner.requests
    d.check_invariants()


def test_a_full_pool_or_the_drafts_context_end_gives_no_draft(tiny):
    path, hf = tiny
    d = drafter(path, draft_pages=8)  # 32 tokens
    a, b, huge = prompts(20, 12, 40)
    for rid, s in (("a", a), ("b", b), ("huge", huge)):
        d.admit(rid, s)
    # a holds ceil((20 + 4 - 1) / 4) = 6 pages; b would need 4 of the 2 left; huge fits in no pool.
    assert d.propose([DraftRequest("a", 4), DraftRequest("b", 4), DraftRequest("huge", 2)]) == [
        greedy_continuation(hf, a, 4), [], []]
    d.release("a")
    assert d.propose([DraftRequest("b", 4)]) == [greedy_continuation(hf, b, 4)]
    d.check_invariants()

    short = drafter(path, context_length=24)  # the draft runs positions < 24 only
    short.admit("a", a[:20])  # its draft tokens fed back run at positions 20, 21, 22, 23
    short.admit("b", huge[:25])
    assert short.propose([DraftRequest("a", 8), DraftRequest("b", 2)]) == [greedy_continuation(hf, a[:20], 5), []]


def test_a_draft_model_of_another_vocabulary_or_no_draft_path_is_refused(tiny, tmp_path):
    path, _ = tiny
    other, _ = save_llama(tmp_path, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        ModelRunner(worker(other), load_checkpoint(path))
    with pytest.raises(ValueError, match="speculative-draft-model-path"):
        WorkerConfig(speculative_algorithm="STANDALONE")


def test_engine_greedy_output_is_the_same_with_and_without_standalone_speculation(tiny):
    from services.common.model_path import resolve_model_path
    from services.engine.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from services.tokenizer.text_tokenizer import load_tokenizer
    path, _ = tiny
    tokenizer, checkpoint = load_tokenizer(resolve_model_path(None)), load_checkpoint(path)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for spec in (None, "STANDALONE"):
        config = WorkerConfig(dtype="float32", page_size=PAGE, kv_cache_bytes=1 << 20, max_requests=4,
                              speculative_algorithm=spec, speculative_draft_model_path=path if spec else None,
                              speculative_draft_kv_cache_bytes=64 * BYTES_PER_PAGE)
        engine = Engine(worker=config, scheduler=SchedulerConfig(speculative_cost_model="fixed"),  # drafts at any cost
                        checkpoint=checkpoint, tokenizer=tokenizer)
        try:
            outputs[spec] = [engine.generate(input_ids=p, sampling=sampling).token_ids for p in prompts(9, 14)]
            stats = engine.scheduler.stats
            assert (stats.spec_draft_tokens > 0) == (spec is not None)
            if spec:  # the target's own weights draft: every draft token is accepted
                assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        finally:
            engine.shutdown()
            del engine
            gc.collect()
    assert outputs["STANDALONE"] == outputs[None]
