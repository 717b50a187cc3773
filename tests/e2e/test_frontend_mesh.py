"""The frontend language against a real mesh (`radixmesh up`, the default model, float32, greedy):
radixmesh.lang's gen equals the same /generate made by hand, select picks what the prompt's
logprobs say, a fork's branches find the parent's prefix cached, streaming and run_batch give
the same text; the gRPC backend (the tokenizer's Generate) gives the HTTP backend's texts and choices,
the OpenAI backend (/v1/completions) the text the openai client gets and the same choices (by vLLM's
prompt_logprobs); /flush_cache empties the prefix cache; then SGLang's own frontend
(sglang.RuntimeEndpoint, unchanged) runs gen, select, fork and regex programs against the gateway.
One mesh for the module, stopped explicitly."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest

from radixmesh.lang import (BackendError, GrpcBackend, HttpBackend, OpenAIBackend, function, gen, greedy_token_selection, select, system,
                            token_length_normalized, unconditional_likelihood_normalized, user, assistant)
from tests.integration.mesh_harness import gateway_mesh

pytestmark = pytest.mark.slow

MESH_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(64 << 20), "--max-requests", "16",
              "--max-running-requests", "16", "--context-length", "1024", "--check-invariants"]
PROMPT = "Q: What is the capital of France?\nA:"


@pytest.fixture(scope="module")
def mesh():
    with gateway_mesh(*MESH_FLAGS) as m:
        yield m


@pytest.fixture(scope="module")
def backend(mesh):
    return HttpBackend(mesh.url, timeout_s=60)


def _generate(url: str, body: dict):
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_gen_equals_the_request_by_hand_and_streams_the_same(mesh, backend):
    @function
    def prog(s, q):
        s += system("Answer in one short sentence.")
        s += user(q)
        s += assistant(gen("a", max_tokens=12))

    state = prog.run(q="What is the capital of France?", backend=backend)
    prompt = state.text()[:-len(state["a"]) - len(backend.role_format().end("assistant"))]
    by_hand = _generate(mesh.url, {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert state["a"] == by_hand["text"] and state["a"]
    streamed = prog.run(q="What is the capital of France?", backend=backend, stream=True)
    assert "".join(streamed.text_iter()) == state.text()
    # run_batch: the same texts, the constant system turn prefilled once
    states = prog.run_batch([{"q": "What is the capital of France?"}, {"q": "Name a colour."}], backend=backend,
                            num_threads=2)
    assert states[0]["a"] == state["a"]
    assert prog.constant_prefix(backend).endswith(backend.role_format().end("system") + backend.role_format().begin("user"))


def test_select_picks_what_the_logprobs_say(mesh, backend):
    choices = [" Paris", " London", " a city in Europe"]

    @function
    def prog(s):
        s += PROMPT
        s += select("c", choices)

    state = prog.run(backend=backend)
    n = _generate(mesh.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})["meta_info"]["prompt_tokens"]
    assert n > 0
    rows = _generate(mesh.url, {"text": [PROMPT + c for c in choices], "sampling_params": {"max_new_tokens": 0},
                                "return_logprob": True, "logprob_start_len": n})
    means = [sum(lp for lp, _, _ in r["meta_info"]["input_token_logprobs"]) / len(r["meta_info"]["input_token_logprobs"])
             for r in rows]
    assert state["c"] == choices[max(range(3), key=means.__getitem__)]
    assert state.get_meta_info("c")["scores"] == pytest.approx(means, abs=1e-4)
    for method in (greedy_token_selection, unconditional_likelihood_normalized):
        @function
        def other(s, method=method):
            s += PROMPT
            s += select("c", choices, method)

        assert other.run(backend=backend)["c"] in choices


def test_token_healing_scores_the_merged_token(backend):
    @function
    def prog(s):
        s += "Q: What is the capital of France?\nA: The capital is "  # ends with a space
        s += select("c", ["Paris", "London"])

    state = prog.run(backend=backend)
    assert state["c"] == "Paris"
    assert all(len(t) >= 1 for t in state.get_meta_info("c")["token_logprobs"])


def test_fork_branches_find_the_parent_prefix_cached(backend):
    @function
    def prog(s):
        s += system("You are a careful planner who thinks in small steps. " * 4)
        s += user("Plan a picnic for four friends in the park on Saturday afternoon.")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += assistant(f"Step {i + 1}:", gen("step", max_tokens=8))
        forks.join()
        s.meta["branches"] = [f.get_meta_info("step") for f in forks]

    state = prog.run(backend=backend)
    assert len(state["step"]) == 3 and all(isinstance(x, str) for x in state["step"])
    parent = backend.prefill(state.text())["prompt_tokens"]  # the fork left the parent's text as it was
    metas = state.meta["branches"]
    assert parent > 60 and all(m["cached_tokens"] >= parent - 16 for m in metas), (parent, metas)


# --- the gRPC and OpenAI backends, /flush_cache ------------------------------------------

@function
def qa_then_pick(s, q):
    s += system("Answer in one short sentence.")
    s += user(q)
    s += assistant(gen("a", max_tokens=12))
    s += PROMPT
    s += select("c", [" Paris", " London", " a city in Europe"])


def test_grpc_backend_gives_the_http_backends_text_and_choice(mesh, backend):
    grpc_backend = GrpcBackend(mesh.addresses["tokenizer"], timeout_s=60)
    try:
        assert grpc_backend.role_format() == backend.role_format()
        over_http = qa_then_pick.run(q="What is the capital of France?", backend=backend)
        over_grpc = qa_then_pick.run(q="What is the capital of France?", backend=grpc_backend)
        assert over_grpc.text() == over_http.text() and over_grpc["a"]
        assert over_grpc["c"] == over_http["c"]
        assert over_grpc.get_meta_info("c")["scores"] == pytest.approx(over_http.get_meta_info("c")["scores"], abs=1e-4)
        meta = over_grpc.get_meta_info("a")
        assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] > 0
        assert meta["cached_tokens"] > 0  # the HTTP run left this prompt cached
        streamed = qa_then_pick.run(q="What is the capital of France?", backend=grpc_backend, stream=True)
        assert "".join(streamed.text_iter()) == over_http.text()
    finally:
        grpc_backend.close()


def test_openai_backend_gen_equals_the_openai_client_and_selects_by_prompt_logprobs(mesh, backend):
    openai = pytest.importorskip("openai")
    ob = OpenAIBackend(mesh.url + "/v1", timeout_s=60)
    assert ob.radixmesh and ob.role_format() == backend.role_format()
    over_openai = qa_then_pick.run(q="What is the capital of France?", backend=ob)
    prompt = over_openai.text()[:-len(over_openai["a"]) - len(ob.role_format().end("assistant") + PROMPT)
                                - len(over_openai["c"])]
    by_hand = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none").completions.create(
        model=ob.model, prompt=prompt, max_tokens=12, temperature=0)
    assert over_openai["a"] == by_hand.choices[0].text and over_openai["a"]
    over_http = qa_then_pick.run(q="What is the capital of France?", backend=backend)
    assert over_openai.text() == over_http.text()
    assert over_openai.get_meta_info("c")["scores"] == pytest.approx(over_http.get_meta_info("c")["scores"], abs=1e-4)

    @function
    def number(s):
        s += "A number:" + gen("n", max_tokens=6, regex=r" [0-9]{1,3}")

    assert re.fullmatch(r" [0-9]{1,3}", number.run(backend=ob)["n"])
    ob.radixmesh = False  # as another OpenAI-compatible server: no constraints
    with pytest.raises(BackendError, match="needs a radixmesh server"):
        number.run(backend=ob)["n"]


def test_flush_cache_drops_every_cached_prefix(mesh, backend):
    body = {"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 0}}
    _generate(mesh.url, body)
    assert _generate(mesh.url, body)["meta_info"]["cached_tokens"] > 0
    for _ in range(50):  # a request cut by a stop string may still be ending at the scheduler
        try:
            backend.flush_cache()
            break
        except BackendError as e:
            assert "running" in str(e) and "HTTP 400" in str(e), e
            time.sleep(0.1)
    else:
        pytest.fail("the scheduler never went idle")
    assert _generate(mesh.url, body)["meta_info"]["cached_tokens"] == 0
    grpc_backend = GrpcBackend(mesh.addresses["tokenizer"], timeout_s=60)
    try:
        grpc_backend.flush_cache()  # ModelAdmin.FlushCache at the tokenizer, forwarded to its scheduler
        assert grpc_backend.prefill(PROMPT * 4)["cached_tokens"] == 0
    finally:
        grpc_backend.close()


# --- SGLang's own frontend, unchanged ---------------------------------------------------

def test_sglang_frontend_runs_gen_select_fork_and_regex(mesh, backend):
    sgl = pytest.importorskip("sglang", reason="make setup installs sglang (--no-deps) for this test")
    sgl.set_default_backend(sgl.RuntimeEndpoint(mesh.url))

    @sgl.function
    def program(s):
        s += PROMPT
        s += sgl.gen("answer", max_tokens=10, temperature=0)
        s += "\nIs that right?"
        s += sgl.select("verdict", choices=[" yes", " no"])
        s += "\nA number:" + sgl.gen("num", max_tokens=6, regex=r" [0-9]{1,3}", temperature=0)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}:" + sgl.gen("idea", max_tokens=6, temperature=0)
        forks.join()

    state = program.run()
    by_hand = _generate(mesh.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}})
    assert state["answer"] == by_hand["text"]
    assert state["verdict"] in (" yes", " no")
    assert re.fullmatch(r" [0-9]{1,3}", state["num"])
    assert len(state["idea"]) == 2 and all(isinstance(x, str) for x in state["idea"])

    @function
    def ours(s):
        s += PROMPT + by_hand["text"] + "\nIs that right?"
        s += select("verdict", [" yes", " no"], token_length_normalized)

    assert ours.run(backend=backend)["verdict"] == state["verdict"]
