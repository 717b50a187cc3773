"""The mesh over real gRPC: `radixmesh up --no-gateway` in a subprocess, requests through the
tokenizer's Generate, compared with the in-process Engine on the same model.

One mesh per module (a small KV pool, queued prompt tokens capped at 300 so
RESOURCE_EXHAUSTED can be provoked). Parity requests run one at a time with the
prefix cache flushed on both sides, so both compute exactly the same batches.
"""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from protos.radixmesh.v1 import common_pb2, scheduler_pb2, tokenizer_pb2
from protos.radixmesh.v2 import tokenizer_pb2_grpc as tokenizer2_grpc
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.integration.mesh_harness import REPO, SMALL_MESH, Mesh, chat, collect, finish_reason, greedy, stats

QUEUED_TOKENS_CAP = 300


@pytest.fixture(scope="module")
def mesh_and_engine(checkpoint, tokenizer):
    mesh = Mesh(*SMALL_MESH, "--max-queued-tokens", str(QUEUED_TOKENS_CAP))
    try:
        # Load the reference engine while the mesh starts.
        engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=16),
                        scheduler=SchedulerConfig(max_running_requests=16), checkpoint=checkpoint,
                        tokenizer=tokenizer)
        mesh.wait_ready()
        yield mesh, engine
        engine.shutdown()
        # The launcher SIGKILLed cannot stop its children: the kernel tells them (PDEATHSIG).
        mesh.proc.kill()
        mesh.proc.wait()
        assert mesh.leftover_children(timeout=20) == []
    finally:
        mesh.kill_all()


@pytest.fixture(scope="module")
def mesh(mesh_and_engine) -> Mesh:
    return mesh_and_engine[0]


@pytest.fixture(scope="module")
def engine(mesh_and_engine) -> Engine:
    return mesh_and_engine[1]


def fresh(mesh: Mesh, engine: Engine) -> None:
    """Empty prefix caches on both sides (nothing may be running)."""
    assert mesh.scheduler().FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=10).flushed
    engine.scheduler.kv.cache.reset()


def run(mesh: Mesh, **request) -> dict:
    return collect(mesh.tokenizer().Generate(tokenizer_pb2.GenerateTextRequest(**request), timeout=120))


def assert_same(seq: dict, ref, label: str) -> None:
    assert "error" not in seq, seq
    assert seq["text"] == ref.text, label
    assert seq["token_ids"] == ref.token_ids, label
    assert finish_reason(seq["finish"]) == ref.finish_reason, label
    assert seq["finishes"] == 1, label
    assert seq["usage"][:2] == (ref.prompt_tokens, ref.completion_tokens), label


CASES = [
    ("text", dict(text="The quick brown fox"), dict(prompt="The quick brown fox")),
    ("chat", dict(conversation=chat("What is the capital of France?")),
     dict(messages=[{"role": "user", "content": "What is the capital of France?"}])),
    ("ids", dict(input_ids=tokenizer_pb2.TokenIds(ids=[16, 28, 223, 34, 28, 223, 35, 28, 223, 37, 28])),
     dict(input_ids=[16, 28, 223, 34, 28, 223, 35, 28, 223, 37, 28])),
]


@pytest.mark.parametrize("label,mesh_prompt,engine_prompt", CASES, ids=[c[0] for c in CASES])
def test_greedy_matches_the_engine(mesh, engine, label, mesh_prompt, engine_prompt):
    fresh(mesh, engine)
    ref = engine.generate(sampling=SamplingParams(temperature=0.0, max_new_tokens=24), **engine_prompt)
    seqs = run(mesh, sampling=greedy(24), **mesh_prompt)
    assert list(seqs) == [0]
    assert_same(seqs[0], ref, label)
    if label == "chat":  # ends on EOS: the stop token is counted but has no text
        assert ref.finish_reason == "stop" and seqs[0]["finish"].stop_token_id == seqs[0]["token_ids"][-1]


def test_n2_seeded_samples_match_the_engine_with_seed_plus_index(mesh, engine):
    sampling = dict(temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=1234)
    seqs = run(mesh, text="Once upon a time", n=2, sampling=common_pb2.SamplingParams(**sampling))
    assert sorted(seqs) == [0, 1]
    for i in (0, 1):
        ref = engine.generate("Once upon a time", SamplingParams(**{**sampling, "seed": 1234 + i}))
        assert seqs[i]["token_ids"] == ref.token_ids and seqs[i]["text"] == ref.text, i
        assert finish_reason(seqs[i]["finish"]) == "length"
    assert seqs[0]["token_ids"] != seqs[1]["token_ids"]
    assert seqs[1]["usage"][1] == 32 or seqs[0]["usage"][1] == 32  # counters sum over sequences


def test_v1_clients_are_still_served_as_v2_ones(mesh):
    """radixmesh.v2 changed the request path's contracts; v1's Tokenizer.Generate (chunks, then a
    separate Finish) and Scheduler.Generate (token ids, no text) are still served, and say what v2
    says: the same tokens, text and finish."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=12)
    v1 = run(mesh, text="The capital of France is", sampling=sampling)[0]
    assert v1["finishes"] == 1
    v2_outputs = list(tokenizer2_grpc.TokenizerStub(mesh.channel("tokenizer")).Generate(
        tokenizer_pb2.GenerateTextRequest(text="The capital of France is", sampling=sampling), timeout=120))
    outs = [out for msg in v2_outputs for out in msg.outputs]
    assert "".join(o.text for o in outs) == v1["text"]
    assert [t for o in outs for t in o.token_ids] == v1["token_ids"]
    assert [o.finish for o in outs if o.HasField("finish")] == [v1["finish"]]  # once, on the last output
    ids = [tok for tok in mesh.tokenizer().Tokenize(tokenizer_pb2.TokenizeRequest(
        texts=tokenizer_pb2.TextBatch(texts=["The capital of France is"])), timeout=30).items[0].ids]
    raw = collect(mesh.scheduler().Generate(scheduler_pb2.GenerateRequest(
        rid="v1-scheduler", input_ids=ids, sampling=sampling), timeout=120))[0]
    assert raw["token_ids"] == v1["token_ids"] and raw["text"] == ""  # ids only: text is downstream
    assert finish_reason(raw["finish"]) == finish_reason(v1["finish"])


def test_stop_string_across_tokens_is_cut_exactly(mesh, engine):
    full = engine.generate("The quick brown fox", SamplingParams(temperature=0.0, max_new_tokens=24)).text
    # A stop string that starts inside one token and ends inside the next.
    words = full.split(" ")
    stop = words[3][1:] + " " + words[4][:2]
    assert stop in full and not full.startswith(stop)
    before = stats(mesh)
    seqs = run(mesh, text="The quick brown fox", sampling=greedy(24, stop=[stop]))
    ref = engine.generate("The quick brown fox", SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]))
    seq = seqs[0]
    assert seq["text"] == full[:full.index(stop)] == ref.text
    assert seq["finish"].stop_str == stop and finish_reason(seq["finish"]) == "stop"
    assert seq["token_ids"] == ref.token_ids
    after = wait_idle(mesh)
    assert after.finished == before.finished + 1 and after.aborted == before.aborted  # ended as a stop


def test_logprobs_when_asked(mesh, engine):
    fresh(mesh, engine)
    sp = dict(temperature=0.0, max_new_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True)
    ref = engine.generate("The quick brown fox", SamplingParams(**sp))
    seq = run(mesh, text="The quick brown fox", sampling=greedy(**sp))[0]
    assert len(seq["logprobs"]) == len(seq["token_ids"]) == 6
    for got, tok, want in zip(seq["logprobs"], ref.token_ids, ref.logprobs):
        assert got.token_id == tok and got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
        # the tokenizer names each token (text, bytes), alternatives included
        assert (got.token, got.token_bytes) == engine.tokenizer.token_text(tok)
        assert [(t.token, t.token_bytes) for t in got.top] == [engine.tokenizer.token_text(t.token_id) for t in want.top]
    assert "".join(lp.token for lp in seq["logprobs"]) == seq["text"] == ref.text
    assert all(lp.token for lp in seq["logprobs"])
    plain = run(mesh, text="The quick brown fox", sampling=greedy(3))[0]
    assert plain["logprobs"] == []


def test_unset_max_new_tokens_gets_the_room_left(mesh):
    """max_new_tokens unset: what the context leaves after the prompt (here the KV pool, smaller
    than the model's context, is the bound), at most default_max_new_tokens."""
    s = stats(mesh)
    room = s.kv_pages_total * s.page_size
    capped = run(mesh, text="Once upon a time", default_max_new_tokens=5,
                 sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert finish_reason(capped["finish"]) == "length" and len(capped["token_ids"]) == 5
    answer = run(mesh, conversation=chat("What is the capital of France?"),
                 sampling=common_pb2.SamplingParams(temperature=0.0))[0]  # ends on EOS, not at 128
    assert finish_reason(answer["finish"]) == "stop" and "Paris" in answer["text"]
    with pytest.raises(grpc.RpcError) as err:
        run(mesh, input_ids=tokenizer_pb2.TokenIds(ids=[28] * room), sampling=common_pb2.SamplingParams())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"leaves no room for output within the KV cache's {room} tokens" in err.value.details()


BAD = [
    (dict(sampling=greedy(4)), "give one of text, conversation or input_ids"),
    (dict(text="hi", sampling=greedy(4, temperature=-1.0)), "temperature must be >= 0"),
    (dict(text="", sampling=greedy(4)), "the prompt is empty"),
    (dict(input_ids=tokenizer_pb2.TokenIds(ids=[1, 999999]), sampling=greedy(4)), "outside the vocabulary"),
    (dict(text="hi", sampling=greedy(9000)), "exceeds the model's context length"),
    (dict(text="hi", sampling=greedy(4), n=0), "n must be in"),
    (dict(conversation=tokenizer_pb2.Conversation(), sampling=greedy(4)), "the conversation has no messages"),
    (dict(text="hi", sampling=greedy(4, top_p=0.0)), "top_p must be in (0, 1]"),
]


def test_bad_input_is_invalid_argument_and_the_mesh_keeps_serving(mesh):
    for request, message in BAD:
        with pytest.raises(grpc.RpcError) as err:
            run(mesh, **request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert message in err.value.details(), (request, err.value.details())
    with pytest.raises(grpc.RpcError) as full:  # alone above the queued-token cap
        run(mesh, input_ids=tokenizer_pb2.TokenIds(ids=[28] * (QUEUED_TOKENS_CAP + 50)), sampling=greedy(4))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"limit {QUEUED_TOKENS_CAP}" in full.value.details()
    seq = run(mesh, text="The quick brown fox", sampling=greedy(4, ignore_eos=True))[0]
    assert finish_reason(seq["finish"]) == "length" and len(seq["token_ids"]) == 4


def wait_idle(mesh: Mesh, timeout: float = 120) -> scheduler_pb2.SchedulerStats:
    end = time.monotonic() + timeout
    while (s := stats(mesh)).num_running or s.num_waiting:
        assert time.monotonic() < end, s
        time.sleep(0.05)
    return s


def test_cancelled_stream_aborts_and_frees_its_kv(mesh):
    before = wait_idle(mesh)
    assert before.kv_pages_used == before.kv_pages_cached  # idle: only the cache holds pages
    call = mesh.tokenizer().Generate(tokenizer_pb2.GenerateTextRequest(
        text="Tell me a long story about a dragon.", sampling=greedy(300, ignore_eos=True)), timeout=120)
    got = [next(call) for _ in range(3)]
    running = stats(mesh)
    assert running.num_running == 1 and running.kv_pages_used > running.kv_pages_cached
    call.cancel()
    assert all(ev.WhichOneof("event") == "chunk" for ev in got)
    after = wait_idle(mesh)
    # ended by the abort, not by running to its 300 tokens
    assert after.aborted == before.aborted + 1 and after.finished == before.finished, after
    assert after.kv_pages_used == after.kv_pages_cached  # nothing private left: back to the baseline
    assert mesh.scheduler().FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=10).flushed
    assert stats(mesh).kv_pages_used == 0


def test_example_grpc_client(mesh):
    proc = subprocess.run([sys.executable, "examples/grpc_client.py", "--address", mesh.addresses["tokenizer"],
                           "--max-tokens", "16", "What is the capital of France?"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "[STOP; prompt" in proc.stdout


def test_info_and_ready(mesh):
    stub = mesh.tokenizer()
    info = stub.Info(tokenizer_pb2.InfoRequest(), timeout=10)
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and info.has_chat_template
    ready = stub.Ready(tokenizer_pb2.ReadyRequest(), timeout=10)
    assert ready.ready and {s.stage for s in ready.stages} == {"scheduler", "worker", "detokenizer"}
    tok = stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=tokenizer_pb2.TextBatch(texts=["a b", "c"])), timeout=10)
    assert len(tok.items) == 2 and all(item.ids for item in tok.items)
