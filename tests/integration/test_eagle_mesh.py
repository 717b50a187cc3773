"""EAGLE-3 through the real mesh (`--speculative-algorithm EAGLE3` alone, the gateway, real gRPC):
chat prompts stream the same greedy text with the shipped head drafting as with the request's
opt-out (`speculative: false`), tree drafts included, and the usage reports drafts accepted."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.integration.mesh_harness import SMALL_MESH, Mesh
from tests.integration.test_speculative_mesh import stream_chat

pytestmark = pytest.mark.slow

PROMPTS = json.loads((Path(__file__).parents[2] / "services" / "worker" / "speculative" / "data"
                      / "draft_prompts.json").read_text())["prompts"]
CHAT = [p["messages"] for p in PROMPTS if p["split"] == "heldout"]


@pytest.mark.parametrize("flags", [[], ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]],
                         ids=["chain", "tree"])
def test_eagle3_streams_the_opt_outs_text_and_reports_acceptance(flags):
    mesh = Mesh(*SMALL_MESH, "--speculative-algorithm", "EAGLE3", "--speculative-cost-model", "fixed", *flags,
                gateway=True)
    try:
        mesh.wait_ready()
        with urllib.request.urlopen(mesh.url + "/v1/models", timeout=30) as r:
            mesh.model = json.load(r)["data"][0]["id"]
        accepted = drafted = 0
        for messages in CHAT[:3]:
            spec_text, spec_usage, _ = stream_chat(mesh, messages)
            plain_text, plain_usage, _ = stream_chat(mesh, messages, speculative=False)
            assert spec_text == plain_text and spec_usage["completion_tokens"] == plain_usage["completion_tokens"]
            assert "speculative" not in plain_usage
            counts = spec_usage.get("speculative") or {}
            accepted += counts.get("accepted_tokens", 0)
            drafted += counts.get("draft_tokens", 0)
        assert 0 < accepted <= drafted
        assert mesh.stop() == 0
    finally:
        mesh.kill_all()
