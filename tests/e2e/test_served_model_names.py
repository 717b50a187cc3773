"""`radixmesh up --served-model-name a b` over real HTTP (issue 14): the launcher forwards both
names to the gateway; /v1/models reports the first, requests may name either, responses carry
the first, and the model's own id is refused once names are given."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import services.launcher.up  # noqa: E402,F401 (the launcher the tests drive)

from tests.integration.mesh_harness import Mesh  # noqa: E402

pytestmark = pytest.mark.slow

MESH_FLAGS = ["--kv-cache-bytes", str(32 << 20), "--max-requests", "4", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def url():
    m = Mesh("--served-model-name", "a", "b", *MESH_FLAGS, gateway=True)
    try:
        m.wait_ready()
        listening = next(e for e in m.log if e.get("service") == "gateway" and e.get("msg") == "listening")
        yield f"http://127.0.0.1:{listening['http_port']}"
        assert m.stop() == 0
        assert m.leftover_children() == []
    finally:
        m.kill_all()


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_report_the_first_name(url):
    status, models = http(f"{url}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["a"]
    assert http(f"{url}/v1/models/b")[1]["id"] == "a"


@pytest.mark.parametrize("name", ["a", "b"])
def test_either_name_gets_a_completion_carrying_the_first(url, name):
    status, body = http(f"{url}/v1/chat/completions", {
        "model": name, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    assert body["model"] == "a" and body["choices"][0]["message"]["content"]


def test_the_models_own_id_is_refused_naming_the_served_ones(url):
    status, body = http(f"{url}/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "model_not_found"
    assert body["error"]["message"].endswith("this server serves 'a', 'b'")
