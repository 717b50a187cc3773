"""Traces, metrics and logs of the real mesh (`radixmesh up` with the gateway), one mesh per module.

Tracing goes to a real OTLP/gRPC receiver started here (opentelemetry-proto's TraceService,
tests/integration/otlp_receiver.py) through the standard OTEL_* variables; every service's
/metrics (--metrics-port 0: each logs the port it bound) is parsed with prometheus_client's parser.
"""
from __future__ import annotations

import http.client
import json
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.mesh_harness import SMALL_MESH, Mesh, gateway_url_and_metrics, otlp_env
from tests.integration.otlp_receiver import Receiver, Span

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def mesh(receiver):
    m = Mesh(*SMALL_MESH, "--metrics-port", "0", gateway=True, env=otlp_env(receiver.endpoint))
    try:
        m.wait_ready()
        m.url, m.metrics_urls = gateway_url_and_metrics(m, SERVICES)
        m.metrics_urls["gateway"] = m.url + "/metrics"
        with urllib.request.urlopen(m.url + "/v1/models", timeout=30) as r:
            m.model = json.load(r)["data"][0]["id"]
        yield m
        assert m.stop() == 0
    finally:
        m.kill_all()


def post(mesh: Mesh, path: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(mesh.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.load(r)


def chat(mesh: Mesh, content: str, max_tokens: int = 6, headers: dict | None = None) -> dict:
    return post(mesh, "/v1/chat/completions", {"model": mesh.model, "max_tokens": max_tokens, "temperature": 0,
                                               "messages": [{"role": "user", "content": content}]}, headers)


def trace_of(receiver: Receiver, request_id: str, timeout: float = 20) -> list[Span]:
    """Every span of the trace whose gateway span served request_id, once all have arrived
    (the worker's request span ends at the release, a step after the response)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.spans()
        gw = [s for s in spans if s.service == "radixmesh-gateway" and s.kind == "SERVER"
              and s.attributes.get("radixmesh.request_id") == request_id]
        if gw:
            trace = [s for s in spans if s.trace_id == gw[0].trace_id]
            have = {(s.service.removeprefix("radixmesh-"), s.name, s.kind) for s in trace}
            # Spans are exported as they end, each service on its own clock: the ones that end
            # last (the worker's request span at the release, the detokenizer's at the finish, the
            # gateway's client span when the stream is read) must all be here.
            if {("worker", "worker.request", "INTERNAL"), ("scheduler", "decode", "INTERNAL"),
                    ("gateway", "tokenizer.generate", "CLIENT"), ("tokenizer", "tokenizer.generate", "SERVER"),
                    ("tokenizer", "radixmesh.v2.Scheduler/Submit", "CLIENT"),
                    ("scheduler", "radixmesh.v2.Scheduler/Submit", "SERVER"),
                    ("detokenizer", "detokenize", "INTERNAL")} <= have:
                return trace
        assert time.monotonic() < deadline, (f"no complete trace for {request_id}: "
                                             f"{[(s.service, s.name, s.trace_id, s.attributes) for s in spans]}")
        time.sleep(0.1)


def one(trace: list[Span], name: str, service: str, kind: str | None = None) -> Span:
    found = [s for s in trace if s.name == name and s.service == f"radixmesh-{service}"
             and (kind is None or s.kind == kind)]
    assert len(found) == 1, (name, service, kind, [(s.name, s.service, s.kind) for s in trace])
    return found[0]


def check_tree(trace: list[Span]) -> dict[str, Span]:
    """The request's spans with their parent/child relations; returns them by role."""
    gw = next(s for s in trace if s.service == "radixmesh-gateway" and s.kind == "SERVER")
    # The gateway's requests share one GenerateStream call; each carries its client span's
    # traceparent, under which the tokenizer admits it (radixmesh.v2, docs/architecture.md).
    gw_client = one(trace, "tokenizer.generate", "gateway", "CLIENT")
    tok = one(trace, "tokenizer.generate", "tokenizer", "SERVER")
    sched_client = one(trace, "radixmesh.v2.Scheduler/Submit", "tokenizer", "CLIENT")
    sched = one(trace, "radixmesh.v2.Scheduler/Submit", "scheduler", "SERVER")
    llm = one(trace, "llm_request", "scheduler")
    parent_of = {
        gw_client.span_id: gw.span_id, tok.span_id: gw_client.span_id,
        one(trace, "tokenize", "tokenizer").span_id: tok.span_id,
        sched_client.span_id: tok.span_id, sched.span_id: sched_client.span_id, llm.span_id: sched.span_id,
        one(trace, "queue", "scheduler").span_id: llm.span_id, one(trace, "decode", "scheduler").span_id: llm.span_id,
        one(trace, "worker.request", "worker").span_id: llm.span_id,
        one(trace, "detokenize", "detokenizer").span_id: llm.span_id}
    prefills = [s for s in trace if s.name == "prefill"]
    assert prefills and all(s.parent_id == llm.span_id for s in prefills)
    by_id = {s.span_id: s for s in trace}
    for child, parent in parent_of.items():
        assert by_id[child].parent_id == parent, (by_id[child].name, by_id[child].service)
    assert {s.service for s in trace} == {f"radixmesh-{name}" for name in SERVICES}
    return {"gateway": gw, "llm": llm}


def test_one_trace_covers_every_service_with_genai_attributes(mesh, receiver):
    body = chat(mesh, "What is the capital of France?")
    trace = trace_of(receiver, body["id"])
    spans = check_tree(trace)
    gw, llm, usage = spans["gateway"], spans["llm"], body["usage"]
    assert gw.parent_id == "" and gw.name == "POST /v1/chat/completions"
    reason = body["choices"][0]["finish_reason"]
    for span in (gw, llm):
        a = span.attributes
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert a["gen_ai.response.finish_reasons"] == [reason]
        assert a["gen_ai.request.model"] == mesh.model
        assert a["gen_ai.request.temperature"] == 0
        assert a["radixmesh.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert gw.attributes["gen_ai.request.max_tokens"] == llm.attributes["gen_ai.request.max_tokens"] == 6
    a = llm.attributes
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_model_prefill"] > 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] <= a["gen_ai.latency.e2e"]
    decode = one(trace, "decode", "scheduler")
    assert decode.attributes["radixmesh.decode_steps"] == usage["completion_tokens"] - 1
    # Worker steps are roots of their own traces, linked to the requests they served.
    steps = [s for s in receiver.spans() if s.name == "worker.step" and (llm.trace_id, llm.span_id) in s.links]
    assert len(steps) >= usage["completion_tokens"] and all(s.parent_id == "" for s in steps)
    assert one(trace, "worker.request", "worker").attributes["radixmesh.steps"] == len(steps)
    # A log line leads to the trace.
    lines = [json.loads(line) for line in mesh.raw_stderr if body["id"] in line]
    done = [e for e in lines if e.get("service") == "gateway" and e.get("msg") == "done"]
    assert done and done[0]["trace_id"] == gw.trace_id and done[0]["request_id"] == body["id"]


def test_traceparent_is_continued_and_concurrent_requests_never_mix(mesh, receiver):
    prompts = ["Name a color.", "Count to three.", "Say hello in French."]
    parents = [(secrets.token_hex(16), secrets.token_hex(8)) for _ in prompts]

    def send(i: int) -> dict:
        tid, sid = parents[i]
        return chat(mesh, prompts[i], max_tokens=3 + i, headers={"traceparent": f"00-{tid}-{sid}-01"})

    with ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(send, range(len(prompts))))
    for (tid, sid), body in zip(parents, bodies):
        trace = trace_of(receiver, body["id"])
        spans = check_tree(trace)  # exactly one of each: nothing from another request
        assert spans["gateway"].trace_id == tid and spans["gateway"].parent_id == sid
        assert {s.trace_id for s in trace} == {tid}
        ids = {s.attributes["radixmesh.request_id"] for s in trace if "radixmesh.request_id" in s.attributes}
        assert ids == {body["id"]}
        assert spans["llm"].attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]


def test_scrapes_and_health_checks_make_no_spans(mesh, receiver):
    before = len(receiver.spans())
    for url in mesh.metrics_urls.values():
        scrape(url)
    for path in ("/health", "/ready"):
        urllib.request.urlopen(mesh.url + path, timeout=10).read()
    time.sleep(1.5)  # the gateway's readiness monitor polls Ready/health every second meanwhile
    assert len(receiver.spans()) == before


# --- metrics ---------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def scrape_all(mesh: Mesh) -> dict[str, dict]:
    return {name: scrape(url) for name, url in mesh.metrics_urls.items()}


def delta(after: dict, before: dict, service: str, name: str, **labels) -> float:
    return total(after[service], name, **labels) - total(before[service], name, **labels)


def settled(mesh: Mesh) -> dict[str, dict]:
    """Scrapes once nothing runs and the worker has run every step the scheduler counted."""
    deadline = time.monotonic() + 60
    while True:
        s = scrape_all(mesh)
        running = total(s["scheduler"], "radixmesh:num_requests_running")
        steps = total(s["scheduler"], "radixmesh:scheduler_steps_total")
        if (running == 0 and steps == total(s["worker"], "radixmesh:worker_steps_total")) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_metrics_count_what_was_served(mesh):
    before = settled(mesh)
    prefix = "You are a careful assistant who answers briefly and precisely. " * 4
    questions = ["What is the capital of Italy?", "What is the capital of Spain?", "Name a prime number."]
    bodies = [chat(mesh, prefix + q, max_tokens=2 + i) for i, q in enumerate(questions)]
    after = settled(mesh)
    n = len(bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    reasons = [b["choices"][0]["finish_reason"] for b in bodies]
    d = lambda service, name, **labels: delta(after, before, service, name, **labels)  # noqa: E731

    assert d("scheduler", "radixmesh:prompt_tokens_total") == prompt
    assert d("scheduler", "radixmesh:generation_tokens_total") == generated
    for reason in set(reasons):
        assert d("scheduler", "radixmesh:request_success_total", finished_reason=reason) == reasons.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert d("scheduler", f"radixmesh:{hist}_count") == n, hist
    assert d("scheduler", "radixmesh:request_prompt_tokens_sum") == prompt
    assert d("scheduler", "radixmesh:request_generation_tokens_sum") == generated
    assert d("scheduler", "radixmesh:inter_token_latency_seconds_count") == generated - n
    assert d("scheduler", "radixmesh:prefix_cache_queries_total") == n
    assert d("scheduler", "radixmesh:prefix_cache_hits_total") >= n - 1  # the shared prefix was cached
    assert d("scheduler", "radixmesh:prefix_cache_hit_tokens_total") > 0
    s = after["scheduler"]
    assert total(s, "radixmesh:kv_pages_total") > 0 and 0 <= total(s, "radixmesh:token_usage") <= 1
    assert d("gateway", "radixmesh:http_requests_total", route="/v1/chat/completions", status_code="200") == n
    assert d("gateway", "radixmesh:gateway_prompt_tokens_total") == prompt
    assert d("gateway", "radixmesh:gateway_generation_tokens_total") == generated
    assert d("tokenizer", "radixmesh:tokenizer_requests_total") == n
    assert d("tokenizer", "radixmesh:tokenize_seconds_count") == n
    assert d("detokenizer", "radixmesh:detokenizer_requests_total") == n
    assert d("worker", "radixmesh:worker_steps_total") == d("scheduler", "radixmesh:scheduler_steps_total") > 0
    # Device split (services/worker/device_stats.py): on the CPU every forward is an eager launch,
    # with no device to wait for and no graphs; steps that only release requests run no forward.
    assert 0 < d("worker", "radixmesh:worker_eager_steps_total") <= d("worker", "radixmesh:worker_steps_total")
    assert d("worker", "radixmesh:worker_step_launch_seconds_total") > 0
    assert d("worker", "radixmesh:worker_step_device_seconds_total") == 0
    assert d("worker", "radixmesh:worker_cuda_graph_replays_total") == 0
    for service, samples in after.items():  # one model_name everywhere, the one /v1/models reports
        names = {dict(labels)["model_name"] for (name, labels) in samples if name.startswith("radixmesh:")}
        assert names == {mesh.model}, service


def test_an_aborted_request_is_counted_as_aborted(mesh):
    before = settled(mesh)
    conn = http.client.HTTPConnection(mesh.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": mesh.model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
         "ignore_eos": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while delta(scrape_all(mesh), before, "scheduler", "radixmesh:request_aborted_total") < 1:
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.1)
    after = settled(mesh)
    assert delta(after, before, "scheduler", "radixmesh:request_aborted_total") == 1
    assert delta(after, before, "scheduler", "radixmesh:request_success_total") == 0
