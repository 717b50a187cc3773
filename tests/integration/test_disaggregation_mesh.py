"""Prefill/decode disaggregation between two real replicas (`radixmesh up`, real model, float32):
the request goes to both tokenizers with the pairing the router would give it, the decode side's
stream is the client's. Compared token for token with a third, co-located replica run with the
same flags, for FP8 KV with the kvstore tier: every case on the default transfer backend (grpc),
and on the others the cases whose KV crosses differently (one chunk, many chunks, a shared prefix
already on the decode side, cancellation); the rest (stops, logprobs, grammar, seeds, adapters)
only continue on the decode side what crossed. Every replica loads a LoRA adapter that one case
uses. Cancelled pairs leave the KV pages on both sides back at their
baseline (killed replicas: test_disaggregation_faults.py)."""
from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from protos.radixmesh.v1 import common_pb2, tokenizer_pb2
from services.router.pairing import side_request
from services.router.roles import DECODE, PREFILL
from tests.integration.mesh_harness import SMALL_MESH, Mesh, chat, collect, greedy, stats

pytestmark = pytest.mark.slow

PD_FLAGS = [*SMALL_MESH, "--chunked-prefill-size", "64"]  # long prompts cross chunk by chunk
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, in plain English, and never "
          "invent facts. " * 6)


def meshes(*modes: str, backend: str = "grpc", extra: tuple[str, ...] = ()) -> list[Mesh]:
    started = []
    try:
        for mode in modes:
            flags = [*PD_FLAGS, *extra] if mode == "null" else [
                *PD_FLAGS, *extra, "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
            started.append(Mesh(*flags))
        for mesh in started:
            mesh.wait_ready()
    except Exception:
        for mesh in started:
            mesh.kill_all()
        raise
    return started


# Every replica here: FP8 KV, the kvstore tier, a LoRA adapter (plain KV through PD: the fleet's
# end-to-end test, tests/e2e/test_disaggregated_fleet.py).
COMPOSED = ("--kv-cache-dtype", "fp8_e4m3", "--kvstore")
BACKENDS = ("grpc", "shm", "mooncake")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_model) -> str:
    """A random rank-8 LoRA adapter of every linear of the default model (PEFT's format)."""
    from bench.common.random_adapter import make_random_adapter
    return make_random_adapter(hf_model, str(tmp_path_factory.mktemp("lora") / "a"), 8, 16, seed=3)


@pytest.fixture(scope="module")
def expected(adapter) -> dict:
    """A co-located replica's output for every case (run first, then stopped: no more than three
    replicas share the machine at once)."""
    colocated, = meshes("null", extra=(*COMPOSED, "--lora-paths", f"a={adapter}"))
    try:
        return {case: collect(colocated.tokenizer().Generate(req, timeout=120))[0] for case, req in CASES.items()}
    finally:
        colocated.stop()


@pytest.fixture(scope="module")
def pair(request, expected, adapter):
    """(prefill, decode) replicas moving KV with one transfer backend (the tests' indirect
    parameter: pytest groups the tests by it, so each pair starts once)."""
    started = meshes("prefill", "decode", backend=request.param, extra=(*COMPOSED, "--lora-paths", f"a={adapter}"))
    yield started
    for mesh in started:
        mesh.stop()


def bootstrap(prefill: Mesh) -> str:
    info = prefill.tokenizer().Info(tokenizer_pb2.InfoRequest(), timeout=10)
    assert info.disaggregation_mode == "prefill" and info.bootstrap_address
    return info.bootstrap_address


def paired(request: tokenizer_pb2.GenerateTextRequest, address: str, room: str | None = None):
    """The request as the router sends it to each side (services/router/pairing.py)."""
    room = room or uuid.uuid4().hex
    return (side_request(request, f"{request.rid}-p", PREFILL, room),
            side_request(request, f"{request.rid}-d", DECODE, room, address))


def run_pair(prefill: Mesh, decode: Mesh, request, timeout: float = 120) -> tuple[dict, dict]:
    """Both sides at once; (decode side's sequences, prefill side's)."""
    to_prefill, to_decode = paired(request, bootstrap(prefill))
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault(
        "p", collect(prefill.tokenizer().Generate(to_prefill, timeout=timeout))))
    thread.start()
    try:
        decoded = collect(decode.tokenizer().Generate(to_decode, timeout=timeout))
    finally:
        thread.join(timeout)
    return decoded, out.get("p")


def request(content: str, **sampling) -> tokenizer_pb2.GenerateTextRequest:
    max_new = sampling.pop("max_new_tokens", 24)
    return tokenizer_pb2.GenerateTextRequest(rid=uuid.uuid4().hex, conversation=chat(content),
                                             sampling=greedy(max_new, **sampling))


CASES = {
    "story": request("Tell me a short story about a lighthouse keeper."),
    "ends-by-eos": request("What is the capital of France? Answer in one sentence.", max_new_tokens=40),
    "stop-string": request("Count from one to ten in words, separated by commas.", stop=[" five"]),
    "logprobs": request("Name three primary colors.", logprobs=True, top_logprobs=3, max_new_tokens=12),
    "long-prompt": request(SYSTEM + "Now say hello.", max_new_tokens=16),
    "regex": request("Give me a date.", max_new_tokens=16,
                     constraint=common_pb2.Constraint(kind="regex", spec=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
    "lora": request(SYSTEM + "Describe the sea.", max_new_tokens=16),
    # sampled at a seed: the decode side's draws continue the prefill side's noise counter
    "seeded": request("Invent a name for a cat.", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11),
}
CASES["lora"].adapter = "a"
# The cases the other transfer backends run: those whose KV crosses in another shape (one chunk, many).
TRANSFER_SHAPES = ("story", "long-prompt")


@pytest.mark.parametrize("pair", ["grpc"], indirect=True, scope="module")
@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_output_equals_colocated(pair, expected, case):
    assert_pair_equals_colocated(pair, expected, case)


@pytest.mark.parametrize("pair", [b for b in BACKENDS if b != "grpc"], indirect=True, scope="module")
@pytest.mark.parametrize("case", TRANSFER_SHAPES)
def test_every_transfer_backend_gives_the_colocated_output(pair, expected, case):
    assert_pair_equals_colocated(pair, expected, case)


def assert_pair_equals_colocated(pair, expected, case):
    prefill, decode = pair
    got, prefill_side = run_pair(prefill, decode, CASES[case])
    expected = expected[case]
    assert -1 not in got, got.get(-1)
    seq = got[0]
    assert seq["token_ids"] == expected["token_ids"], (seq["text"], expected["text"])
    assert seq["text"] == expected["text"]
    assert seq["finish"] == expected["finish"]
    prompt, completion, cached = seq["usage"]
    assert (prompt, completion) == expected["usage"][:2]
    assert 0 <= cached <= prompt
    assert len(seq["logprobs"]) == len(expected["logprobs"])
    for a, b in zip(seq["logprobs"], expected["logprobs"]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    # the prefill side sampled the client's first token, and stopped there
    assert prefill_side[0]["token_ids"] == seq["token_ids"][:1]
    assert settle(prefill, decode) == [0, 0]  # no page is left private on either side


def private_pages(mesh: Mesh) -> int:
    s = stats(mesh)
    return s.kv_pages_used - s.kv_pages_cached


def settle(*sides: Mesh, timeout: float = 30) -> list[int]:
    end = time.monotonic() + timeout
    while True:
        pages = [private_pages(m) for m in sides]
        if not any(pages) or time.monotonic() > end:
            return pages
        time.sleep(0.2)


@pytest.mark.parametrize("pair", BACKENDS, indirect=True, scope="module")
def test_a_shared_prefix_crosses_once(pair):
    prefill, decode = pair
    hits_before = stats(decode).cache_hit_tokens
    first, _ = run_pair(prefill, decode, request(SYSTEM + "Say one word.", max_new_tokens=4))
    second, _ = run_pair(prefill, decode, request(SYSTEM + "Say two words.", max_new_tokens=4))
    assert first[0]["finish"] is not None and second[0]["finish"] is not None
    prompt = second[0]["usage"][0]
    # the decode side matched the shared system prompt in its own cache: only the rest crossed
    assert stats(decode).cache_hit_tokens - hits_before >= prompt // 2
    assert settle(prefill, decode) == [0, 0]


@pytest.mark.parametrize("pair", BACKENDS, indirect=True, scope="module")
def test_cancelled_pairs_free_their_pages_on_both_sides(pair):
    prefill, decode = pair
    address = bootstrap(prefill)
    calls = []
    for i in range(4):
        req = request(SYSTEM + f"Write a long essay about topic number {i}.", max_new_tokens=200)
        to_prefill, to_decode = paired(req, address)
        calls.append(prefill.tokenizer().Generate(to_prefill, timeout=120))
        calls.append(decode.tokenizer().Generate(to_decode, timeout=120))
    decode_calls = calls[1::2]
    next(iter(decode_calls[0]))  # one is decoding, the others anywhere from queued to crossing
    time.sleep(0.3)
    for call in decode_calls:  # the client goes away
        call.cancel()
    for call in calls[::2]:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass
    assert settle(prefill, decode) == [0, 0]
