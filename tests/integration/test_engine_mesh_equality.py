"""The in-process Engine and the mesh answer the same requests the same way (issue 33).

One `radixmesh up` (float32, NGRAM speculation, jump-forward) and one Engine with the same flags
run the same requests, one at a time, in the same order; their texts, finish reasons, matched
stops, usage and logprobs must be equal. The cases are where the two used to drift apart:

- speculative steps ending in EOS (copy-heavy chats: the drafter's run is accepted up to the
  end): the Engine dropped the whole final step's text, the mesh only the EOS;
- a jump-forward step ending in EOS (a choice constraint forces the rest of the answer);
- stop strings whose text spans several steps;
- n > 1 (sampled, seeded: each sequence is reproducible alone), which only the mesh had;
- logprobs with their top alternatives and token strings.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import grpc
import pytest

from protos.radixmesh.v1 import common_pb2 as cpb
from protos.radixmesh.v1 import tokenizer_pb2 as pb
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.convert import sampling_to_proto
from services.common.grammar.constraint import Constraint
from services.common.outputs import FinishReason, RequestOutput
from services.common.outputs_convert import output_from_proto
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.mesh_harness import SMALL_MESH, Mesh

pytestmark = pytest.mark.slow

COPY_CHATS = json.loads((Path(__file__).parents[2] / "bench" / "data" / "copy_heavy.json").read_text())[:4]
FLAGS = ["--speculative-algorithm", "NGRAM", "--speculative-cost-model", "fixed", "--jump-forward"]


@pytest.fixture(scope="module")
def both(checkpoint, tokenizer):
    engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=16,
                                        speculative_algorithm="NGRAM", jump_forward=True),
                    scheduler=SchedulerConfig(max_running_requests=16, speculative_cost_model="fixed"),
                    checkpoint=checkpoint, tokenizer=tokenizer)
    mesh = Mesh(*SMALL_MESH, *FLAGS)
    try:
        mesh.wait_ready()
        channel = grpc.insecure_channel(mesh.addresses["tokenizer"])
        yield engine, tokenizer2_grpc.TokenizerStub(channel)
        channel.close()
        assert mesh.stop() == 0
    finally:
        mesh.kill_all()
        engine.shutdown()


def through_mesh(stub, ids: list[int], sampling: SamplingParams, n: int) -> list[RequestOutput]:
    request = pb.GenerateTextRequest(input_ids=pb.TokenIds(ids=ids), sampling=sampling_to_proto(sampling), n=n)
    outputs: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
    for msg in stub.Generate(request, timeout=300):
        assert not msg.HasField("error"), msg.error
        for out in msg.outputs:
            outputs[out.index].append(output_from_proto(out))
    return [RequestOutput.joined(outputs[i]) for i in range(n)]


def assert_same(engine_outs: list[RequestOutput], mesh_outs: list[RequestOutput], case: str) -> None:
    for e, m in zip(engine_outs, mesh_outs, strict=True):
        what = f"{case}, sequence {e.index}"
        assert (e.text, e.token_ids) == (m.text, m.token_ids), what
        assert (e.finish_reason, e.matched_stop) == (m.finish_reason, m.matched_stop), what
        assert (e.prompt_tokens, e.completion_tokens, e.cached_tokens) == (
            m.prompt_tokens, m.completion_tokens, m.cached_tokens), what
        assert len(e.logprobs) == len(m.logprobs), what
        for a, b in zip(e.logprobs, m.logprobs):
            assert (a.token_id, a.token, a.bytes) == (b.token_id, b.token, b.bytes), what
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5), what
            assert [(t.token_id, t.token) for t in a.top] == [(t.token_id, t.token) for t in b.top], what


def assert_whole_text(engine: Engine, out: RequestOutput, case: str) -> None:
    """Without a stop string, the text is every token's but a matched stop token's, decoded at once
    (the reference both sides are held to, not only each other)."""
    if isinstance(out.matched_stop, str):
        return
    ids = out.token_ids[:-1] if isinstance(out.matched_stop, int) else out.token_ids
    assert out.text == engine.tokenizer.decode(ids), case


def run_both(both, ids: list[int], sampling: SamplingParams, n: int = 1, case: str = "") -> list[RequestOutput]:
    engine, stub = both
    engine_outs = engine.generate_n(input_ids=ids, sampling=sampling, n=n, timeout=300)
    assert_same(engine_outs, through_mesh(stub, ids, sampling, n), case)
    for out in engine_outs:
        assert_whole_text(engine, out, case)
    return engine_outs


def test_speculative_steps_that_end_in_eos(both):
    engine, _ = both
    stopped_by_eos = 0
    for i, chat in enumerate(COPY_CHATS):
        ids = engine.prompt_ids(messages=chat["messages"])
        (out,) = run_both(both, ids, SamplingParams(temperature=0.0, max_new_tokens=96), case=f"copy chat {i}")
        stopped_by_eos += out.finish_reason is FinishReason.STOP and isinstance(out.matched_stop, int)
    assert stopped_by_eos > 0  # the case this is about happened


def test_a_jump_forward_step_that_ends_in_eos(both):
    engine, _ = both
    ids = engine.prompt_ids(messages=[{"role": "user", "content": "Is the sky blue? Answer in a sentence."}])
    choice = Constraint("choice", json.dumps(["Yes, the sky is blue on a clear day.", "No, it is not."]))
    (out,) = run_both(both, ids, SamplingParams(temperature=0.0, max_new_tokens=32, constraint=choice), case="choice")
    assert out.text in json.loads(choice.spec) and out.finish_reason is FinishReason.STOP


def test_stop_strings_that_span_steps(both):
    engine, _ = both
    ids = engine.prompt_ids(prompt="The three largest cities in France are")
    plain = engine.generate(input_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=24))
    pieces = [engine.tokenizer.decode([t]) for t in plain.token_ids]
    start = len(pieces[0]) + len(pieces[1])
    stop = (pieces[2] + pieces[3] + pieces[4])[1:]  # from inside one token's text to the end of a later one
    assert len(stop) > 2, pieces
    (out,) = run_both(both, ids, SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]), case="stop string")
    assert out.matched_stop == stop and out.text == plain.text[:start + 1]


def test_n_sampled_sequences(both):
    engine, _ = both
    ids = engine.prompt_ids(messages=[{"role": "user", "content": "Write a short poem about the sea."}])
    outs = run_both(both, ids, SamplingParams(temperature=0.8, max_new_tokens=16, seed=7), n=3, case="n=3")
    assert len({o.text for o in outs}) > 1  # seeds seed, seed+1, seed+2: different samples


def test_logprobs(both):
    engine, _ = both
    ids = engine.prompt_ids(prompt="The capital of France is")
    (out,) = run_both(both, ids, SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=True, top_logprobs=2),
                      case="logprobs")
    assert len(out.logprobs) == out.completion_tokens and all(lp.token is not None for lp in out.logprobs)
