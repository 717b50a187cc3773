"""Greedy agreement's arithmetic, the bundled prompt set, and the reference configuration."""
from __future__ import annotations

import pytest

from services.eval.agreement import agreement, common_prefix
from services.eval.config import AgreementConfig, PerplexityConfig
from services.eval.corpus import BUNDLED, corpus_path, load_prompts, read_corpus
from services.eval.runs import reference_worker
from services.worker.config import WorkerConfig


def test_common_prefix_stops_at_the_first_divergence():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2], [1, 2]) == 2
    assert common_prefix([5], [6]) == 0


def test_agreement_is_the_mean_fraction_before_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [2, 1, 1, 1]]
    r = agreement(ref, got, 4)
    assert r.matched == (4, 2, 0)
    assert r.mean_fraction == pytest.approx(6 / 12)
    assert r.exact == 1
    assert r.as_dict()["prompts"] == 3
    with pytest.raises(ValueError, match="2 reference outputs but 1"):
        agreement(ref[:2], got[:1], 4)


def test_bundled_corpus_and_prompts():
    chat, text = load_prompts()
    assert 16 <= len(chat) + len(text) <= 32 and len(set(chat + text)) == len(chat) + len(text)
    assert len(read_corpus("kjv")) > 250_000 and "In the beginning God created" in read_corpus("kjv")
    assert "def heappush" in read_corpus("code")
    for name in BUNDLED:
        assert corpus_path(name).endswith(BUNDLED[name])
    with pytest.raises(ValueError, match="bundled corpora"):
        corpus_path("no-such-corpus")


def test_reference_is_float32_dense_with_default_kv():
    cfg = AgreementConfig(worker=WorkerConfig(model="m.gguf", dtype="bfloat16", kv_cache_bytes=1 << 26,
                                              quant_max_rows=0))
    ref = reference_worker(cfg)
    assert (ref.model, ref.dtype, ref.kv_cache_bytes, ref.quant_max_rows) == ("m.gguf", "float32", 1 << 26, 2)
    assert reference_worker(AgreementConfig(reference_model="src.gguf")).model == "src.gguf"


def test_config_refusals():
    with pytest.raises(ValueError, match="--reference-dtype"):
        AgreementConfig(reference_dtype="fp8")
    with pytest.raises(ValueError, match="--stride"):
        PerplexityConfig(window=8, stride=9)
    with pytest.raises(ValueError, match="--max-tokens"):
        PerplexityConfig(max_tokens=1)
