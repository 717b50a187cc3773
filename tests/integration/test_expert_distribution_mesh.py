"""SGLang's expert distribution recorder through the real mesh: `radixmesh up --router` on a tiny
random Qwen3-MoE (gateway -> router -> tokenizer -> scheduler -> worker), a recording started over
HTTP with the admin key, two greedy /generate requests, stop, dump. Every MoE layer's row adds up
to the tokens the model ran x num_experts_per_tok (the worker's worker_tokens_total says how many
it ran), each (layer, expert) count equals what the worker's /metrics expert_tokens_total grew by,
the router's answer holds the one replica's recording, and the dump loads as an
--init-expert-location file."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from services.worker.model.expert_load import ExpertDump
from tests.integration.mesh_harness import Mesh, gateway_url_and_metrics
from tests.integration.test_mesh_observability import scrape, total
from tests.unit.tiny_models import MOE, save_for_generation

pytestmark = pytest.mark.slow

ADMIN = "admin-key-for-expert-tests"
TINY_MESH = ["--dtype", "float32", "--kv-cache-bytes", str(4 << 20), "--max-requests", "4",
             "--max-running-requests", "4", "--check-invariants"]
PROMPTS = [list(range(3, 15)), list(range(100, 107))]  # no shared first page: no prefix cache hit
NEW_TOKENS = 5


def call(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_record_the_experts_over_http(tmp_path):
    path, _ = save_for_generation(tmp_path / "model", "qwen3_moe")
    mesh = Mesh("--model", path, *TINY_MESH, "--router", "--admin-api-key", ADMIN, "--metrics-port", "0",
                gateway=True)
    try:
        mesh.wait_ready(timeout=300)
        url, metrics = gateway_url_and_metrics(mesh, ["worker"])
        status, body = call(url, "GET", "/admin/expert_distribution/dump")
        assert status == 400 and "start a recording first" in body["error"]["message"], body
        before = scrape(metrics["worker"])
        status, started = call(url, "POST", "/admin/expert_distribution/start")
        assert status == 200 and started["recording"] and started["forwards"] == 0, started
        for prompt in PROMPTS:
            status, out = call(url, "POST", "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0}})
            assert status == 200 and len(out["output_ids"]) == NEW_TOKENS, out
        assert call(url, "POST", "/stop_expert_distribution_record")[0] == 200  # SGLang's name
        status, dump = call(url, "GET", "/admin/expert_distribution/dump")
        after = scrape(metrics["worker"])
        assert status == 200 and not dump["recording"] and dump["forwards"] > 0, dump

        run = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)  # the last sampled token is never fed back
        assert total(after, "radixmesh:worker_tokens_total") - total(before, "radixmesh:worker_tokens_total") == run
        assert dump["layers"] == [0, 1]
        assert [sum(row) for row in dump["logical_count"]] == [run * MOE["num_experts_per_tok"]] * 2
        grew = [[total(after, "radixmesh:expert_tokens_total", layer=str(layer), expert=str(e))
                 - total(before, "radixmesh:expert_tokens_total", layer=str(layer), expert=str(e))
                 for e in range(MOE["num_experts"])] for layer in dump["layers"]]
        assert grew == dump["logical_count"]
        [replica] = dump["replicas"]  # behind the router: one per replica, the top level their sum
        assert replica["address"] and replica["logical_count"] == dump["logical_count"]

        saved = tmp_path / "experts.json"
        saved.write_text(json.dumps(dump))
        loaded = ExpertDump.load(str(saved))
        assert loaded.layers == [0, 1] and loaded.logical_count == dump["logical_count"]
        assert mesh.stop() == 0
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()
