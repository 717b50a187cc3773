"""Multi-LoRA and weight updates through the real mesh and its HTTP gateway (`radixmesh up`):
/v1/models lists adapters with the base as parent; a request naming an adapter (OpenAI `model`,
native `adapter`) gets PEFT's merged-model output; adapters load and unload at run time with
the admin key only; a weight update from disk, with a request running, retracts it and serves
the new weights' output (the reference of a fresh model on them), bumps weights_version
everywhere, recomputes a prompt cached before it (cached_tokens 0); a failed update says why and
leaves the old weights serving."""
from __future__ import annotations

import copy
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from bench.common.random_adapter import make_random_adapter
from tests.integration.mesh_harness import SMALL_MESH, Mesh, gateway_url_and_metrics
from tests.integration.reference import assert_matches, greedy_reference
from tests.unit.lora_fixtures import merged

pytestmark = pytest.mark.slow

ADMIN = "admin-key-for-tests"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"r8": make_random_adapter(hf_model, str(root / "r8"), 8, 16, seed=11),
            "r16": make_random_adapter(hf_model, str(root / "r16"), 16, 32, seed=12, use_rslora=True)}


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory, hf_model) -> tuple[str, object]:
    """An HF safetensors checkpoint of the model with every weight nudged, and that model."""
    model = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * float(p.float().std()))
    path = tmp_path_factory.mktemp("new-weights")
    save_hf_checkpoint(model, path)
    return str(path), model


def save_hf_checkpoint(model, path) -> None:
    """config.json + model.safetensors (save_pretrained refuses a model transformers read from a GGUF)."""
    from safetensors.torch import save_file
    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(path / "model.safetensors"))
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mesh(adapters):
    m = Mesh(*SMALL_MESH, "--lora-paths", f"r8={adapters['r8']}", "--max-loras", "2", "--admin-api-key", ADMIN,
             gateway=True)
    try:
        m.wait_ready()
        m.url, _ = gateway_url_and_metrics(m, [])
        yield m
        assert m.stop() == 0
    finally:
        m.kill_all()


def call(mesh: Mesh, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(mesh.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=500) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def generate(mesh: Mesh, ids: list[int], adapter: str = "", n: int = NEW_TOKENS) -> dict:
    status, body = call(mesh, "/generate", {"input_ids": ids, "adapter": adapter or None, "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("A short story about a lighthouse keeper who finds a message in a bottle. " * 3)


def test_adapters_listed_and_served_as_peft_merged(mesh, hf_model, adapters, prompt):
    status, models = call(mesh, "/v1/models")
    assert status == 200
    base, *rest = models["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in rest] == [("r8", base["id"], adapters["r8"])]
    out = generate(mesh, prompt, "r8")
    assert_matches(out["output_ids"], greedy_reference(merged(hf_model, adapters["r8"]), prompt, NEW_TOKENS), "r8")
    status, body = call(mesh, "/v1/completions", {"model": "r8", "prompt": "Hello", "max_tokens": 4})
    assert status == 200 and body["model"] == "r8" and body["system_fingerprint"] == "weights-v0"
    status, body = call(mesh, "/v1/completions", {"model": "nope", "prompt": "Hello", "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "model_not_found"
    status, body = call(mesh, "/generate", {"input_ids": prompt, "adapter": "nope"})
    assert status == 400 and "unknown LoRA adapter 'nope'" in body["error"]["message"]


def test_load_and_unload_at_run_time_with_the_admin_key(mesh, hf_model, adapters, prompt, tmp_path):
    body = {"lora_name": "r16", "lora_path": adapters["r16"]}
    assert call(mesh, "/v1/load_lora_adapter", body)[0] == 401
    status, state = call(mesh, "/v1/load_lora_adapter", body, key=ADMIN)
    assert status == 200 and sorted(a["name"] for a in state["adapters"]) == ["r16", "r8"], state
    assert "r16" in [m["id"] for m in call(mesh, "/v1/models")[1]["data"]]
    out = generate(mesh, prompt, "r16")
    assert_matches(out["output_ids"], greedy_reference(merged(hf_model, adapters["r16"]), prompt, NEW_TOKENS), "r16")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 128, "lora_alpha": 8,
                                                              "target_modules": ["q_proj"]}))
    status, err = call(mesh, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path)}, key=ADMIN)
    assert status == 400 and "adapter_model.safetensors" in err["error"]["message"], err
    status, state = call(mesh, "/v1/unload_lora_adapter", {"lora_name": "r16"}, key=ADMIN)
    assert status == 200 and [a["name"] for a in state["adapters"]] == ["r8"]
    assert call(mesh, "/v1/unload_lora_adapter", {"lora_name": "r16"}, key=ADMIN)[0] == 404
    assert call(mesh, "/generate", {"input_ids": prompt, "adapter": "r16"})[0] == 400


def test_weight_update_from_disk_retracts_flushes_and_bumps_the_version(mesh, hf_model, new_weights, prompt,
                                                                        tokenizer, tmp_path):
    path, new_model = new_weights
    before = generate(mesh, prompt)
    assert generate(mesh, prompt)["meta_info"]["cached_tokens"] > 0  # cached under version 0
    status, err = call(mesh, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")}, key=ADMIN)
    assert status == 400 and "old weights keep serving" in err["error"]["message"], err
    assert generate(mesh, prompt)["output_ids"] == before["output_ids"]
    running: dict = {}
    other = tokenizer.encode("An unrelated question about the history of tea in England.")
    long_one = threading.Thread(target=lambda: running.update(generate(mesh, other, n=200)))
    long_one.start()  # running while the update comes: retracted, re-run on the new weights
    status, state = call(mesh, "/update_weights_from_disk", {"model_path": path, "running": "retract"}, key=ADMIN)
    long_one.join(timeout=500)
    assert status == 200 and state["weights_version"] == "1", state
    report = state["update"]
    assert report["path"] == "disk" and int(report["bytes"]) > 100e6 and int(report["flushed_pages"]) > 0
    after = generate(mesh, prompt)
    assert after["meta_info"]["cached_tokens"] == 0, "a prefix cached under the old weights was reused"
    assert after["meta_info"]["weights_version"] == "1"
    assert_matches(after["output_ids"], greedy_reference(new_model, prompt, NEW_TOKENS), "after the update")
    assert after["output_ids"] != before["output_ids"]
    assert running["meta_info"]["weights_version"] == "1" and len(running["output_ids"]) == 200
    assert [m["weights_version"] for m in call(mesh, "/v1/models")[1]["data"]] == ["1", "1"]
