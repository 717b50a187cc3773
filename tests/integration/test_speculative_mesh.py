"""Speculative decoding through the real mesh (`radixmesh up --speculative-algorithm NGRAM`, the
gateway, tracing to a real OTLP receiver): a copy-heavy chat streams the same greedy text with
speculation as with the request's opt-out (`speculative: false`), its usage reports the verify
counts only when it speculated, the scheduler's /metrics count verifies and accepted tokens and
fill the acceptance-length histogram, and the request's decode span carries the counts."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.mesh_harness import SMALL_MESH, Mesh, gateway_url_and_metrics, otlp_env
from tests.integration.test_mesh_observability import receiver, scrape, total  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

WORKLOAD = json.loads((Path(__file__).parents[2] / "bench" / "data" / "copy_heavy.json").read_text())


@pytest.fixture(scope="module")
def mesh(receiver):
    m = Mesh(*SMALL_MESH, "--speculative-algorithm", "NGRAM", "--speculative-cost-model", "fixed", "--metrics-port", "0",
             gateway=True, env=otlp_env(receiver.endpoint))
    try:
        m.wait_ready()
        m.url, metrics = gateway_url_and_metrics(m, ["scheduler"])
        m.scheduler_metrics = metrics["scheduler"]
        with urllib.request.urlopen(m.url + "/v1/models", timeout=30) as r:
            m.model = json.load(r)["data"][0]["id"]
        yield m
        assert m.stop() == 0
    finally:
        m.kill_all()


def stream_chat(mesh: Mesh, messages: list[dict], **extra) -> tuple[str, dict]:
    body = {"model": mesh.model, "messages": messages, "max_tokens": 48, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(mesh.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, usage, rid = "", None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
    return text, usage, rid


def test_speculation_streams_the_opt_outs_text_and_reports_itself(mesh, receiver):
    before = scrape(mesh.scheduler_metrics)
    for conv in WORKLOAD[:4]:
        spec_text, spec_usage, rid = stream_chat(mesh, conv["messages"])
        plain_text, plain_usage, _ = stream_chat(mesh, conv["messages"], speculative=False)
        assert spec_text == plain_text and spec_usage["completion_tokens"] == plain_usage["completion_tokens"]
        assert "speculative" not in plain_usage
        if "speculative" in spec_usage:
            last = (rid, spec_usage["speculative"])
    rid, counts = last
    assert counts["verify_steps"] > 0 and 0 < counts["accepted_tokens"] <= counts["draft_tokens"]
    after = scrape(mesh.scheduler_metrics)
    grew = {name: total(after, name) - total(before, name) for name in (
        "radixmesh:spec_verify_items_total", "radixmesh:spec_accepted_tokens_total", "radixmesh:spec_steps_total",
        "radixmesh:spec_accept_length_count", "radixmesh:spec_draft_seconds_total")}
    assert all(v > 0 for v in grew.values()), grew
    assert 0 < total(after, "radixmesh:spec_step_share") < 1

    deadline = time.monotonic() + 20
    while True:  # the gateway's request id names the trace; its decode span ends with the request
        spans = receiver.spans()
        gw = [s for s in spans if s.service == "radixmesh-gateway" and s.attributes.get("radixmesh.request_id") == rid]
        decode = [s for s in spans if gw and s.trace_id == gw[0].trace_id and s.name == "decode"]
        if decode:
            break
        assert time.monotonic() < deadline, "no decode span for the speculated request"
        time.sleep(0.1)
    a = decode[0].attributes
    assert a["radixmesh.spec.verify_steps"] == counts["verify_steps"]
    assert a["radixmesh.spec.proposed_tokens"] == counts["draft_tokens"]
    assert a["radixmesh.spec.accepted_tokens"] == counts["accepted_tokens"]
