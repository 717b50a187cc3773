"""Prompt logprobs and embeddings at the worker (services/worker/prompt_extras.py) against
transformers in float32: the prompt's chunks and batch mates must not change them."""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.step.convert import result_from_proto, result_to_proto
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from tests.unit.tiny_models import save_tiny

PAGE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), "qwen3_gqa_tied_wide_heads")


def _runner(path: str, pooling: str = "last"):
    from services.worker.model_runner import ModelRunner
    return ModelRunner(WorkerConfig(dtype="float32", page_size=PAGE, kv_cache_bytes=4 << 20, max_requests=4,
                                    pooling=pooling), load_checkpoint(path))


def _run(runner, prompts: dict[str, list[int]], chunks: dict[str, list[int]], sampling: dict[str, SamplingParams]):
    """Feed every prompt in its chunks (all requests in each step) → the merged results' entries,
    each step's result through the wire form."""
    specs = [NewRequestSpec(rid, p, [], sampling[rid], 0) for rid, p in prompts.items()]
    pos = {rid: 0 for rid in prompts}
    todo = {rid: list(chunks.get(rid, [len(p)])) for rid, p in prompts.items()}
    table = {rid: list(range(i * 32, (i + 1) * 32)) for i, rid in enumerate(prompts)}
    logprobs, embeddings, step = {}, {}, 0
    while any(todo.values()):
        items = []
        for rid, p in prompts.items():
            if todo[rid]:
                n = todo[rid].pop(0)
                items.append(StepItem(rid, p[pos[rid]:pos[rid] + n], pos[rid], table[rid] if pos[rid] == 0 else [],
                                      pos[rid] == 0, sample=pos[rid] + n == len(p)))
                pos[rid] += n
        result = result_from_proto(result_to_proto(runner.execute(StepPlan(step, specs if step == 0 else [], items))))
        for entry in result.prompt_logprobs:
            logprobs.setdefault(entry.rid, []).append(entry)
        for e in result.embeddings:
            embeddings[e.rid] = e.values
        step += 1
    return logprobs, embeddings


def _reference_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]


def test_prompt_logprobs_match_transformers_chunked_and_batched(tiny):
    path, hf = tiny
    g = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(0, 256, (n,), generator=g).tolist() for rid, n in (("a", 23), ("b", 17), ("c", 9))}
    sp = {"a": SamplingParams(temperature=0, prompt_logprobs=3),
          "b": SamplingParams(temperature=0, prompt_logprobs=0, logprob_start_len=6),
          "c": SamplingParams(temperature=0)}  # a batch mate asking nothing
    for chunks in ({}, {"a": [5, 7, 11], "b": [6, 1, 10]}):
        got, _ = _run(_runner(path), prompts, chunks, sp)
        assert "c" not in got
        for rid, k in (("a", 3), ("b", 0)):
            p, ref = prompts[rid], _reference_logprobs(hf, prompts[rid])
            start = max(sp[rid].logprob_start_len, 1)
            entries = got[rid]
            assert entries[0].start == start
            values = [v for e in entries for v in e.logprobs]
            tops = [e.top(i) for e in entries for i in range(len(e.logprobs))]
            assert len(values) == len(p) - start
            for i, value in enumerate(values):
                j = start + i
                assert abs(value - ref[j - 1, p[j]].item()) < 1e-4, (rid, chunks, j)
                if k:
                    ref_v, ref_i = ref[j - 1].topk(k)
                    assert [t for t, _ in tops[i]] == ref_i.tolist()
                    assert max(abs(v - r) for (_, v), r in zip(tops[i], ref_v.tolist())) < 1e-4
                else:
                    assert not any(tops)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_last_hidden_state(tiny, pooling):
    path, hf = tiny
    g = torch.Generator().manual_seed(4)
    prompts = {rid: torch.randint(0, 256, (n,), generator=g).tolist() for rid, n in (("a", 19), ("b", 7))}
    sp = {rid: SamplingParams(temperature=0, max_new_tokens=0, embed=True) for rid in prompts}
    _, whole = _run(_runner(path, pooling), prompts, {}, sp)
    _, chunked = _run(_runner(path, pooling), prompts, {"a": [4, 9, 6], "b": [3, 4]}, sp)
    for rid, p in prompts.items():
        with torch.no_grad():
            hidden = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0].float()  # [L, H]
        ref = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
        for got in (whole[rid], chunked[rid]):
            assert (torch.tensor(got) - ref).abs().max().item() < 1e-4, (rid, pooling)
