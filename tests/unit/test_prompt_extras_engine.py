"""Prompt logprobs, prefill-only requests and embeddings through the scheduler core and the runner
(the in-process Engine) against transformers in float32: chunked prefill, the prefix cache and
batch mates must not change them."""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import InvalidRequest, SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.unit.tiny_models import save_for_generation

PROMPT_LEN = 37


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_for_generation(tmp_path_factory.mktemp("tiny"), "qwen3_mha_untied")


def _engine(path: str, pooling: str = "last", chunk: int = 8) -> Engine:
    # A prefill budget of 8 tokens: every prompt here runs in several chunks, beside other requests.
    return Engine(worker=WorkerConfig(model=path, dtype="float32", page_size=4, kv_cache_bytes=8 << 20,
                                      max_requests=8, pooling=pooling),
                  scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=chunk,
                                            max_prefill_tokens=chunk))


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(out, hf, prompt: list[int], start: int, k: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    lps = out.prompt_logprobs
    assert [lp.token_id for lp in lps] == prompt[start:]
    for j, lp in zip(range(start, len(prompt)), lps):
        if j == 0:
            assert lp.logprob is None and not lp.top
            continue
        assert abs(lp.logprob - ref[j - 1, prompt[j]].item()) < 1e-4, j
        assert [t.token_id for t in lp.top] == ref[j - 1].topk(k).indices.tolist()[:k]
        assert lp.token is not None  # named by the detokenizer's code


def test_prompt_logprobs_chunked_batched_and_cached(tiny):
    path, hf = tiny
    engine = _engine(path)
    try:
        a, b = _prompt(1), _prompt(2)
        # Batched with a plain request, every prompt in several chunks.
        outs = engine.generate_batch([a, b, _prompt(3)], [
            SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=2),
            SamplingParams(temperature=0, max_new_tokens=0, prompt_logprobs=0, logprob_start_len=5),
            SamplingParams(temperature=0, max_new_tokens=3)])
        _check(outs[0], hf, a, 0, 2)
        _check(outs[1], hf, b, 5, 0)
        assert outs[1].token_ids == [] and outs[1].finish_reason == "length"
        assert outs[2].prompt_logprobs == [] and len(outs[2].token_ids) == 3
        # `a` is cached now: asking again from position 20 reuses at most 19 tokens, the rest recomputed.
        again = engine.generate(input_ids=a, sampling=SamplingParams(temperature=0, max_new_tokens=1,
                                                                     prompt_logprobs=1, logprob_start_len=20))
        _check(again, hf, a, 20, 1)
        assert 0 < again.cached_tokens <= 19
        assert again.token_ids == outs[0].token_ids[:1]
        # A prefill-only request caches its prompt like any finished one.
        warm = engine.generate(input_ids=b + [7], sampling=SamplingParams(temperature=0, max_new_tokens=1))
        assert warm.cached_tokens >= 32
        with pytest.raises(InvalidRequest, match="logprob_start_len"):
            engine.generate(input_ids=a, sampling=SamplingParams(prompt_logprobs=0, logprob_start_len=PROMPT_LEN))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_and_ignore_the_cache(tiny, pooling):
    path, hf = tiny
    engine = _engine(path, pooling)
    try:
        a, b = _prompt(4), _prompt(5, 13)
        sp = SamplingParams(max_new_tokens=0, embed=True)
        first = engine.generate_batch([a, b, a], sp)
        second = engine.generate(input_ids=a, sampling=sp)  # `a` is in the cache now
        for out, prompt in ((first[0], a), (first[1], b), (first[2], a), (second, a)):
            with torch.no_grad():
                hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
            ref = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
            got = torch.tensor(out.embedding)
            assert (got - ref).abs().max().item() < 1e-4
            assert out.token_ids == [] and out.cached_tokens == 0
        assert torch.dot(torch.tensor(first[0].embedding), torch.tensor(second.embedding)).item() == \
            pytest.approx(1.0, abs=1e-6)
    finally:
        engine.shutdown()
