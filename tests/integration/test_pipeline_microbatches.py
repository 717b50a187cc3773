"""Pipeline parallelism with micro-batches in flight (services/worker/parallel/pipeline.py): a
step's batch split by request into --pp-micro-batches micro-batches that cross the stages
overlapped gives the logits of one rank within 1e-4 and its greedy text, in float32, on the
default model (PP 2) and on a tiny architecture (TP 2 × PP 2), in steps that mix prefill chunks
and decodes of requests of different lengths; and each stage really computes the micro-batches
one by one (its counter). Groups and helpers are test_tensor_parallel's."""
from __future__ import annotations

import queue

import pytest
import torch

from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.worker.config import WorkerConfig
from services.worker.group.leader import create_runner
from services.worker.parallel.pipeline import split_by_request
from tests.integration.test_tensor_parallel import ATOL, _logits, _save
from tests.unit.tiny_models import BATCHES, logits_by_position, sequences

pytestmark = pytest.mark.slow

WAIT_S = 300  # every wait on a request of the group's


def _assert_same_logits(one: dict, group: dict, label: str) -> None:
    for rid, rows in one.items():
        for (pos, a), (pos2, b) in zip(rows, group[rid], strict=True):
            assert pos == pos2
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=lambda m: f"{label} {rid} position {pos}: {m}")
            assert int(a.argmax()) == int(b.argmax())


def test_micro_batches_split_a_step_by_request_into_contiguous_ranges():
    assert split_by_request([45, 1, 1], 2) == [range(0, 1), range(1, 3)]  # a long prefill chunk alone
    assert split_by_request([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_by_request([1, 1, 30], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_by_request([7], 4) == [range(0, 1)]
    with pytest.raises(ValueError, match="--pp-micro-batches must be >= 1"):
        WorkerConfig(pp_size=2, pp_micro_batches=0)
    with pytest.raises(ValueError, match="--pp-micro-batch-tokens must be >= 1"):
        WorkerConfig(pp_size=2, pp_micro_batch_tokens=0)
    assert WorkerConfig(pp_size=3).resolved_pp_micro_batches == 3


def test_pp2_micro_batches_give_one_ranks_logits_on_the_default_model(checkpoint):
    """Three requests of 45, 30 and 12 tokens, in prefill chunks and decodes: every step of three
    requests crosses the two stages as three micro-batches (the leader's stage counts them)."""
    chunks = {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}
    seqs = sequences("three_chunked")
    flags = dict(dtype="float32", page_size=4, kv_cache_bytes=16 << 20, max_requests=4)
    runner = create_runner(WorkerConfig(**flags), checkpoint)
    try:
        one = logits_by_position(runner, seqs, chunks, 4)
    finally:
        runner.close()
    runner = create_runner(WorkerConfig(pp_size=2, pp_micro_batches=3, pp_micro_batch_tokens=1, **flags), checkpoint)
    try:
        stage = runner.runner.model.pipeline
        steps: list[int] = []  # the items of each step the leader computed
        inner = runner.runner.compute_logits
        runner.runner.compute_logits = lambda plan: (steps.append(len(plan.items)), inner(plan))[1]
        group = logits_by_position(runner, seqs, chunks, 4)
    finally:
        runner.close()
    _assert_same_logits(one, group, "pp 2, 3 micro-batches")
    assert stage.steps == len(steps) and max(steps) == 3
    assert stage.micro_batches == sum(min(3, n) for n in steps) > len(steps)


def _greedy_together(engine: Engine, prompts: list[str]) -> list[RequestOutput]:
    """The prompts submitted at once (they batch together), each awaited within WAIT_S."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=True)
    sinks = [queue.SimpleQueue() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        engine.submit(engine.prompt_ids(prompt, None, None), sp, sink.put)
    outs = []
    for sink in sinks:
        chunks = [sink.get(timeout=WAIT_S)]
        while not chunks[-1].finished:
            chunks.append(sink.get(timeout=WAIT_S))
        outs.append(RequestOutput.joined(chunks))
    return outs


PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
           "1, 2, 3,", "The best way to learn a new language is to"]


def test_pp2_micro_batches_generate_one_ranks_greedy_text_on_the_default_model(checkpoint, tokenizer):
    """Four prompts of different lengths batched together through the Engine: one micro-batch per
    stage, of any size (decodes too)."""
    outs, split = {}, 0
    for pp in (1, 2):
        engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=4, pp_size=pp,
                                            pp_micro_batch_tokens=1),
                        checkpoint=checkpoint, tokenizer=tokenizer)
        try:
            outs[pp] = _greedy_together(engine, PROMPTS)
            if pp == 2:
                stage = engine.runner.runner.model.pipeline
                split = stage.micro_batches - stage.steps  # steps that crossed as two micro-batches
        finally:
            engine.shutdown()
    assert split > 0
    for one, two in zip(outs[1], outs[2], strict=True):
        assert two.token_ids == one.token_ids and two.text == one.text
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, two.logprobs, strict=True)]
        assert max(diffs) < ATOL, diffs


def test_tp2_pp2_micro_batches_give_one_ranks_logits_on_gemma2(tmp_path):
    """Sliding and full attention layers, renumbered per stage; micro-batches of one and two requests."""
    path = _save(tmp_path, "gemma2")
    _assert_same_logits(_logits(path, 1), _logits(path, 2, 2, pp_micro_batches=2, pp_micro_batch_tokens=1), "tp 2 pp 2, 2 micro-batches")
