"""The served model id and `--served-model-name` aliases (issue 14).

The id comes from `services.common.model_path.model_id` (the loaders' ModelConfig.name, reported
by the tokenizer's Info); `--served-model-name ID [ALIAS ...]` replaces it at the gateway: every
name is accepted, the first is what /v1/models reports and responses carry. The gateway runs
in-process on aiohttp's test server with the model-free FakeBackend (its model: "fake-model").
"""
from __future__ import annotations

import argparse
import json
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.config import config_from_args, flags_from_dataclass
from services.common.metrics import model_name_of
from services.common.model_path import DEFAULT_MODEL_ID, default_model_path, model_id
from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.launcher.up import route_flags
from tests.doubles.fake_backend import FakeBackend

ALIASES = GatewayConfig(served_model_name=["org/served-id", "alias"])


def gateway_config(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    flags_from_dataclass(GatewayConfig, parser)
    return config_from_args(GatewayConfig, parser.parse_args(list(argv)))


async def client_for(config: GatewayConfig) -> TestClient:
    client = TestClient(TestServer(build_app(config, FakeBackend(), monitor_backend=False)))
    await client.start_server()
    return client


@pytest.fixture
async def aliased():
    client = await client_for(ALIASES)
    yield client
    await client.close()


async def post(client: TestClient, path: str, body: dict) -> tuple[int, dict | str]:
    r = await client.post(path, json=body)
    return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


# --- the id a model is served under -------------------------------------------------------

def test_the_default_model_is_served_under_its_clean_name():
    path = default_model_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the stem carries the quant
    assert model_id(path) == DEFAULT_MODEL_ID == "SmolLM2-135M-Instruct"
    assert model_name_of(None) == model_name_of("default") == DEFAULT_MODEL_ID  # the detokenizer's label


def test_other_models_are_served_under_their_file_stem_or_directory_name(tmp_path):
    gguf = tmp_path / "Qwen2.5-0.5B-Instruct.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "SmolLM2-135M-Instruct"
    hf.mkdir()
    blob = tmp_path / "sha256-0123abcd"  # a GGUF recognised by content keeps its whole name
    blob.write_bytes(b"GGUF")
    assert model_id(str(gguf)) == "Qwen2.5-0.5B-Instruct.Q8_0"
    assert model_id(str(hf)) == model_id(f"{hf}/") == "SmolLM2-135M-Instruct"
    assert model_id(str(blob)) == "sha256-0123abcd"


# --- flags --------------------------------------------------------------------------------

def test_served_model_name_takes_several_names_and_model_name_one():
    assert gateway_config("--served-model-name", "a", "b/c").served_names == ("a", "b/c")
    assert gateway_config("--model-name", "x").served_names == ("x",)
    assert gateway_config().served_names == ()
    with pytest.raises(ValueError, match="not both"):
        gateway_config("--served-model-name", "a", "--model-name", "x")
    with pytest.raises(ValueError, match="non-blank"):
        GatewayConfig(served_model_name=["a", " "])


def test_radixmesh_up_forwards_every_name_to_the_gateway_only():
    routed = route_flags(["--served-model-name", "a", "b", "--log-level", "debug"],
                         ["worker", "detokenizer", "scheduler", "tokenizer", "gateway"])
    assert routed["gateway"] == ["--served-model-name", "a", "b", "--log-level", "debug"]
    assert all(argv == ["--log-level", "debug"] for name, argv in routed.items() if name != "gateway")


# --- the HTTP API -------------------------------------------------------------------------

async def test_without_flags_the_backends_name_is_served():
    client = await client_for(GatewayConfig())
    try:
        models = await (await client.get("/v1/models")).json()
        status, body = await post(client, "/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 2})
    finally:
        await client.close()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert status == 200 and body["model"] == "fake-model"


async def test_models_report_the_first_name_and_every_name_resolves(aliased):
    models = await (await aliased.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["org/served-id"]
    for name in ("org/served-id", "alias"):
        r = await aliased.get(f"/v1/models/{name}")
        assert r.status == 200 and (await r.json())["id"] == "org/served-id"
    ready = await (await aliased.get("/ready")).json()
    assert ready["model"] == "org/served-id"


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "the quick", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
])
@pytest.mark.parametrize("name", ["org/served-id", "alias"])
async def test_requests_may_name_any_alias_and_responses_carry_the_id(aliased, route, body, name):
    status, whole = await post(aliased, route, {**body, "model": name})
    assert status == 200 and whole["model"] == "org/served-id" and whole["choices"]
    status, text = await post(aliased, route, {**body, "model": name, "stream": True})
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert status == 200 and events and {e["model"] for e in events} == {"org/served-id"}


async def test_unknown_names_are_refused_with_the_served_names(aliased):
    for name in ("fake-model", "default"):  # the backend's own name is not served once aliases are given
        status, body = await post(aliased, "/v1/completions", {"model": name, "prompt": "x"})
        assert status == 400 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert body["error"]["message"] == (f"the model {name!r} does not exist; "
                                            "this server serves 'org/served-id', 'alias'")
    r = await aliased.get("/v1/models/fake-model")
    error = (await r.json())["error"]
    assert r.status == 404 and error["code"] == "model_not_found" and "'org/served-id', 'alias'" in error["message"]


async def test_the_openapi_document_enumerates_every_name(aliased):
    doc = await (await aliased.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["properties"]["model"]["enum"] == ["org/served-id", "alias"]
