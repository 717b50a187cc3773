"""Prompt logprobs and embeddings through the real mesh (`radixmesh up --dtype float32`, the
default model) with the openai SDK and raw HTTP, against transformers in float32: /v1/embeddings
(a batch, token ids, cosine 1 for equal texts, a 400 naming dimensions), /v1/completions with
vLLM's prompt_logprobs and legacy echo + logprobs, /generate's input logprobs (return_logprob,
logprob_start_len) and max_new_tokens 0. One mesh for the module, stopped explicitly."""
from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
import torch

from tests.integration.mesh_harness import gateway_mesh

pytestmark = pytest.mark.slow

# Prefill chunks of 16 tokens: the prompts below run in several chunks.
MESH_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(64 << 20), "--max-requests", "8",
              "--max-running-requests", "8", "--context-length", "512", "--chunked-prefill-size", "16",
              "--check-invariants"]
TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
         "Once upon a time, in a small village by the sea, there lived an old fisherman."]
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
    with gateway_mesh(*MESH_FLAGS) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    """text → (ids, log_softmax of every position's logits [L, V], final hidden states [L, H]), float32."""
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer.encode(text)
            res = hf_model(torch.tensor([ids]), output_hidden_states=True)
            out[text] = (ids, torch.log_softmax(res.logits[0].float(), -1), res.hidden_states[-1][0].float())
    return out


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_embeddings_batch_equal_transformers(client, model, reference):
    t0 = time.monotonic()
    texts = [TEXTS[0], TEXTS[1], TEXTS[0]]
    res = client.embeddings.create(model=model, input=texts)  # the SDK asks for base64 and decodes it
    vecs = [torch.tensor(d.embedding) for d in sorted(res.data, key=lambda d: d.index)]
    assert len(vecs) == 3 and res.usage.prompt_tokens == sum(len(reference[t][0]) for t in texts)
    assert torch.dot(vecs[0], vecs[2]).item() == pytest.approx(1.0, abs=1e-6)
    for text, vec in zip(texts, vecs):
        hidden = reference[text][2]
        ref = torch.nn.functional.normalize(hidden[-1], dim=0)  # --pooling last (the default)
        assert (vec - ref).abs().max().item() < TOL
    by_ids = client.embeddings.create(model=model, input=[reference[TEXTS[1]][0]], encoding_format="float")
    assert (torch.tensor(by_ids.data[0].embedding) - vecs[1]).abs().max().item() < TOL
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="x", dimensions=8)
    assert "dimensions" in e.value.message and e.value.body["param"] == "dimensions"
    assert time.monotonic() - t0 < 60


def test_completions_prompt_logprobs_and_echo(client, model, reference):
    ids, lp, _ = reference[TEXTS[0]]
    res = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=2,
                                    extra_body={"prompt_logprobs": 1})
    choice = res.choices[0]
    tokens = choice.logprobs.token_logprobs
    assert len(tokens) == len(ids) + 2 and tokens[0] is None and choice.logprobs.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(tokens[j] - lp[j - 1, ids[j]].item()) < TOL, j
        assert len(choice.logprobs.top_logprobs[j]) == 2
    assert choice.text.startswith(TEXTS[0])
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for j in range(1, len(ids)):
        entry = vllm[j]
        assert abs(entry[str(ids[j])]["logprob"] - lp[j - 1, ids[j]].item()) < TOL
        best = int(lp[j - 1].argmax())
        assert entry[str(best)]["rank"] == 1 and abs(entry[str(best)]["logprob"] - lp[j - 1, best].item()) < TOL


def test_generate_input_logprobs_and_prefill_only(mesh, reference):
    ids, lp, _ = reference[TEXTS[1]]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    first = _post(mesh.url + "/generate", body)
    assert first["output_ids"] == [] and first["meta_info"]["finish_reason"]["type"] == "length"
    # Again, with the prompt cached now: only the tokens before position 2 may come from the cache.
    second = _post(mesh.url + "/generate", {**body, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert len(second["output_ids"]) == 2 and second["meta_info"]["cached_tokens"] <= 2
    for res in (first, second):
        info = res["meta_info"]
        values, tops = info["input_token_logprobs"], info["input_top_logprobs"]
        assert [v[1] for v in values] == ids[3:] and len(tops) == len(ids) - 3
        for j, (value, top) in zip(range(3, len(ids)), zip(values, tops)):
            assert abs(value[0] - lp[j - 1, ids[j]].item()) < TOL, j
            assert [t[1] for t in top] == lp[j - 1].topk(2).indices.tolist()
    # From position 0: the first token has no logprob.
    whole = _post(mesh.url + "/generate", {**body, "logprob_start_len": 0})
    assert whole["meta_info"]["input_token_logprobs"][0][0] is None
    assert whole["meta_info"]["input_top_logprobs"][0] is None
