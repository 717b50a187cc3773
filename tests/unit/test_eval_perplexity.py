"""The accuracy harness's perplexity (services/eval/perplexity.py) on a tiny random Llama: the windows
score every token once; the paged, chunked prefill gives transformers' number on the same windows;
the chunking does not change it; `radixmesh eval perplexity` runs it end to end."""
from __future__ import annotations

import json

import pytest
import torch

from services.cli import main as cli_main
from services.eval.perplexity import perplexity, windows
from services.eval.reference import transformers_perplexity
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model_runner import ModelRunner
from tests.unit.tiny_models import save_for_generation


@pytest.mark.parametrize("n,window,stride", [(2, 4, 4), (10, 4, 4), (37, 8, 3), (64, 16, 16), (100, 128, 64)])
def test_windows_score_each_token_once_with_context(n, window, stride):
    ws = windows(n, window, stride)
    scored = [t for w in ws for t in range(w.scored_from, w.end)]
    # Each token once, in order; with stride = window a window's first token has no context and goes unscored.
    unscored = {w.begin for w in ws[1:]} if stride == window else set()
    assert scored == [t for t in range(1, n) if t not in unscored]
    for w in ws:
        assert 0 <= w.begin < w.scored_from <= w.end <= n and w.end - w.begin <= window
    assert ws[-1].end == n


def test_window_refusals():
    with pytest.raises(ValueError, match="--stride"):
        windows(10, 4, 5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows(1, 4, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory with a word-level tokenizer, transformers model): the tiny llama of tiny_models."""
    return save_for_generation(tmp_path_factory.mktemp("tiny"), "mistral_no_window")


def _runner(path: str, page_size: int = 4) -> ModelRunner:
    return ModelRunner(WorkerConfig(dtype="float32", page_size=page_size, kv_cache_bytes=1 << 20, max_requests=2),
                       load_checkpoint(path))


def test_paged_chunked_prefill_equals_transformers(tiny):
    path, hf = tiny
    tokens = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = _runner(path)
    ours = perplexity(runner, tokens, window=48, stride=20, chunk=7)  # 7 chunks a window, pages of 4
    ref = transformers_perplexity(hf, tokens, window=48, stride=20)
    assert ours.tokens == ref.tokens == 149
    assert ours.nats_per_token == pytest.approx(ref.nats_per_token, rel=1e-5)
    assert not runner.requests  # every window released
    one_chunk = perplexity(_runner(path, page_size=16), tokens, window=48, stride=20, chunk=48)
    assert one_chunk.nll_sum == pytest.approx(ours.nll_sum, rel=1e-5)


def test_window_larger_than_the_pool_is_refused(tiny):
    runner = ModelRunner(WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 * 2 * 2 * 2 * 16 * 4 * 3,
                                      max_requests=2), load_checkpoint(tiny[0]))
    with pytest.raises(ValueError, match="lower --window or raise --kv-cache-bytes"):
        perplexity(runner, list(range(40)), window=32, stride=32, chunk=8)


def test_cli_prints_json(tiny, tmp_path, capsys):
    path, hf = tiny
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"t{i}" for i in ids))
    assert cli_main(["eval", "perplexity", "--model", path, "--corpus", str(corpus), "--dtype", "float32",
                     "--window", "32", "--stride", "16", "--chunk", "8", "--kv-cache-bytes", str(1 << 20),
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = transformers_perplexity(hf, ids, window=32, stride=16)
    assert got["tokens"] == 59
    assert got["perplexity"] == pytest.approx(ref.perplexity, rel=1e-5)
