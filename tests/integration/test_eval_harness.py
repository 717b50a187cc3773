"""The accuracy harness on the default model: its float32 perplexity is transformers' on the same
corpus and windows (issue 21's gate: within 0.1%), for the English corpus and the code sample; and
greedy agreement runs the bundled prompt set through two engines."""
from __future__ import annotations

import pytest

from services.eval.agreement import greedy_outputs, prompt_ids
from services.eval.config import AgreementConfig
from services.eval.perplexity import perplexity
from services.eval.reference import transformers_perplexity
from services.eval.runs import corpus_tokens, engine_outputs, run_agreement
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("corpus,max_tokens", [("kjv", 1536), ("code", 1024)])
def test_float32_perplexity_is_transformers(checkpoint, hf_model, tokenizer, model_path, corpus, max_tokens):
    tokens = corpus_tokens(model_path, corpus, max_tokens, tokenizer)
    runner = ModelRunner(WorkerConfig(dtype="float32", kv_cache_bytes=64 << 20), checkpoint)
    ours = perplexity(runner, tokens, window=768, stride=384, chunk=256)
    ref = transformers_perplexity(hf_model, tokens, window=768, stride=384)
    assert ours.tokens == ref.tokens == max_tokens - 1
    assert ours.perplexity == pytest.approx(ref.perplexity, rel=1e-3)
    assert 1.5 < ours.perplexity < 30  # a real model on real text, not a broken one


def test_agreement_with_itself_is_one_and_bf16_agrees_mostly(checkpoint, tokenizer):
    cfg = AgreementConfig(worker=WorkerConfig(dtype="float32", kv_cache_bytes=64 << 20), new_tokens=12)
    reference = engine_outputs(cfg.worker, cfg.new_tokens, checkpoint, tokenizer)
    assert len(reference) == 24 and all(len(r) == 12 for r in reference)
    same = run_agreement(cfg, reference=engine_outputs(cfg.worker, cfg.new_tokens, checkpoint, tokenizer))
    assert same.mean_fraction == 1.0 and same.exact == 24  # float32 greedy is batch-invariant
    bf16 = engine_outputs(WorkerConfig(dtype="bfloat16", kv_cache_bytes=64 << 20), 12, checkpoint, tokenizer)
    from services.eval.agreement import agreement
    assert agreement(reference, bf16, 12).mean_fraction > 0.5
