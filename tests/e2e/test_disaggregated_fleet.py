"""A disaggregated fleet as users run it: `radixmesh up --prefill 1 --decode 1` (router pairing the
two replicas, the gateway in front), driven with the official `openai` client.

Greedy float32 output equals the in-process Engine's on the gateway tests' prompts
(tests/e2e/test_gateway_mesh.py); a request's trace holds both replicas' spans under the one
gateway request; the prefill scheduler's /metrics count the KV it sent, the decode scheduler's
each request's transfer wait.
"""
from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_gateway_mesh import CHATS, MAX_TOKENS, MESH_FLAGS, PROMPTS, expected  # noqa: F401 (fixture)
from tests.integration.mesh_harness import Mesh, otlp_env
from tests.integration.otlp_receiver import Receiver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def fleet(expected, receiver):  # noqa: F811 (the imported fixture)
    m = Mesh(*MESH_FLAGS, "--prefill", "1", "--decode", "1", "--metrics-port", "0", gateway=True,
             env=otlp_env(receiver.endpoint))
    try:
        m.wait_ready()
        listening = {e["address"]: e for e in m.log if e.get("msg") == "listening" and "metrics_port" in e}
        m.url = f"http://127.0.0.1:{next(e for e in m.log if e.get('service') == 'gateway' and e.get('msg') == 'listening')['http_port']}"
        m.metrics = {child: f"http://127.0.0.1:{listening[address]['metrics_port']}/metrics"
                     for child, address in m.addresses.items() if address in listening}
        m.client = openai.OpenAI(base_url=m.url + "/v1", api_key="none", timeout=120)
        m.model = m.client.models.list().data[0].id
        yield m
        assert m.stop() == 0
    finally:
        m.kill_all()


def test_completions_and_chats_equal_colocated_serving(fleet, expected):  # noqa: F811
    for i, prompt in enumerate(PROMPTS):
        r = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        want = expected["text", i]
        assert r.choices[0].text == want.text, prompt
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        assert 0 <= (cached or 0) <= r.usage.prompt_tokens
    for i, messages in enumerate(CHATS):
        want = expected["chat", i].text
        r = fleet.client.chat.completions.create(model=fleet.model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0)
        assert r.choices[0].message.content == want
        stream = fleet.client.chat.completions.create(model=fleet.model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_n_above_one_is_refused_by_name(fleet):
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        fleet.client.completions.create(model=fleet.model, prompt="Hi", max_tokens=2, n=2)


def test_one_trace_holds_both_replicas(fleet, receiver):
    trace_id = "5" * 32
    fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                    extra_headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"})
    deadline = time.monotonic() + 20
    while True:
        spans = [s for s in receiver.spans() if s.trace_id == trace_id]
        requests = {s.attributes.get("radixmesh.disaggregation.role"): s for s in spans if s.name == "llm_request"}
        tokenizers = [s for s in spans if s.service == "radixmesh-tokenizer" and s.kind == "SERVER"]
        if {"prefill", "decode"} <= requests.keys() and len(tokenizers) >= 2:
            break
        assert time.monotonic() < deadline, [(s.service, s.name, s.attributes) for s in spans]
        time.sleep(0.2)
    assert requests["prefill"].attributes["radixmesh.disaggregation.room"] == \
        requests["decode"].attributes["radixmesh.disaggregation.room"]
    assert any(s.service == "radixmesh-router" for s in spans)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_transfer_metrics_on_both_sides(fleet):
    fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[1] * 8, max_tokens=2, temperature=0)
    prefill = scrape(fleet.metrics["scheduler-prefill-0"])
    decode = scrape(fleet.metrics["scheduler-decode-0"])
    assert prefill["radixmesh:kv_transfer_bytes_total"] > 0 and prefill["radixmesh:kv_transfer_pages_total"] > 0
    assert prefill["radixmesh:kv_transfer_gbps"] > 0
    assert decode["radixmesh:kv_transfer_request_seconds_count"] >= 1
