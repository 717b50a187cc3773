"""radixmesh.lang's gRPC and OpenAI backends without a server: the requests they build from a gen,
how they read answers back (meta_info, prompt logprobs as rows), and the errors an OpenAI-compatible
server without radixmesh's fields gets. The mesh runs them for real: tests/e2e/test_frontend_mesh.py."""
from __future__ import annotations

import json

import pytest

from protos.radixmesh.v1 import common_pb2
from radixmesh.lang import BackendError, OpenAIBackend, function, gen, select, template
from radixmesh.lang.backend_grpc import request, rows, sampling_proto
from radixmesh.lang.backend_openai import meta_info, vllm_rows


def test_a_gen_becomes_the_tokenizers_sampling_params():
    sp = sampling_proto(gen("a", max_tokens=7, stop="\n", temperature=0.5, top_p=0.9, regex="[a-z]+").sampling_params())
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, list(sp.stop)) == (7, 0.5, pytest.approx(0.9), ["\n"])
    assert (sp.constraint.kind, sp.constraint.spec) == ("regex", "[a-z]+")
    assert not sp.HasField("ignore_eos") and not sp.HasField("prompt_logprobs")
    sp = sampling_proto(gen("a", json_schema={"type": "integer"}, ignore_eos=True).sampling_params())
    assert (sp.constraint.kind, sp.constraint.spec, sp.ignore_eos) == ("json_schema", '{"type": "integer"}', True)
    assert not sp.HasField("top_p")  # unset: the server's default
    assert request("hi", sp).text == "hi" and list(request([1, 2], sp).input_ids.ids) == [1, 2]


def test_prompt_logprobs_become_sglang_rows():
    lps = [common_pb2.TokenLogprob(token_id=5, token="Q"),
           common_pb2.TokenLogprob(token_id=9, logprob=-1.5, token=":")]
    assert rows(lps) == [[None, 5, "Q"], [-1.5, 9, ":"]]
    assert vllm_rows([None, {"9": {"logprob": -1.5, "rank": None, "decoded_token": ":"}}]) == [
        [None, None, None], [-1.5, 9, ":"]]


class FakeOpenAI:
    """What OpenAIBackend._call sees: /models, then canned /completions answers; logs the bodies."""

    def __init__(self, owned_by: str, prompt_logprobs: bool = True) -> None:
        self.owned_by, self.prompt_logprobs, self.bodies = owned_by, prompt_logprobs, []

    def __call__(self, backend, method, path, body=None, root=None):
        if path == "/models":
            return {"data": [{"id": "m", "owned_by": self.owned_by}]}
        assert path == "/completions", path
        self.bodies.append(body)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for i, p in enumerate(prompts):
            c = {"index": i, "text": "ok", "finish_reason": "length"}
            if self.prompt_logprobs and "prompt_logprobs" in body:
                c["prompt_logprobs"] = [None] + [{str(j): {"logprob": -0.5 * j, "decoded_token": ch}}
                                                 for j, ch in enumerate(p[1:], 1)]
            choices.append(c)
        return {"choices": choices, "usage": {"prompt_tokens": len(prompts[0]), "completion_tokens": 1,
                                              "prompt_tokens_details": {"cached_tokens": 2}}}


def _backend(monkeypatch, **kw) -> tuple[OpenAIBackend, FakeOpenAI]:
    fake = FakeOpenAI(**kw)
    monkeypatch.setattr(OpenAIBackend, "_call", lambda self, *a, **kw: fake(self, *a, **kw))
    return OpenAIBackend("http://server/v1", role_format=template.CHATML), fake


@function
def pick(s):
    s += "Q?"
    s += gen("a", max_tokens=3, stop=["\n"])
    s += select("c", [" yes", " no"])


def test_openai_backend_sends_completions_and_selects_by_prompt_logprobs(monkeypatch):
    b, fake = _backend(monkeypatch, owned_by="vllm")
    state = pick.run(backend=b)
    assert fake.bodies[0] == {"model": "m", "prompt": "Q?", "max_tokens": 3, "temperature": 0.0, "stop": ["\n"]}
    assert state["a"] == "ok" and state.get_meta_info("a") == {
        "prompt_tokens": 2, "completion_tokens": 1, "cached_tokens": 2, "finish_reason": {"type": "length", "matched": None}}
    assert fake.bodies[-1]["prompt_logprobs"] == 0 and fake.bodies[-1]["max_tokens"] == 1  # not radixmesh: >= 1
    assert state["c"] in (" yes", " no")
    assert meta_info({}, None)["finish_reason"] is None


def test_openai_backend_refuses_what_another_server_cannot_do(monkeypatch):
    b, _ = _backend(monkeypatch, owned_by="vllm", prompt_logprobs=False)
    with pytest.raises(BackendError, match="without vLLM's prompt_logprobs"):
        pick.run(backend=b)["c"]
    with pytest.raises(BackendError, match="needs a radixmesh server"):
        b.completion_body("x", gen("a", regex="[0-9]"))
    with pytest.raises(BackendError, match="role_format"):
        OpenAIBackend("http://server/v1").role_format()
    with pytest.raises(BackendError, match="cannot flush"):
        b.flush_cache()


def test_openai_backend_sends_radixmesh_its_constraints(monkeypatch):
    b, _ = _backend(monkeypatch, owned_by="radixmesh")
    assert b.completion_body("x", gen("a", regex="[0-9]"))["regex"] == "[0-9]"
    fmt = b.completion_body("x", gen("a", json_schema={"type": "integer"}))["response_format"]
    assert fmt == {"type": "json_schema", "json_schema": {"name": "gen", "schema": {"type": "integer"}}}
    assert json.dumps(fmt)
