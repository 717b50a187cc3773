"""`radixmesh bench` for real over HTTP: our gateway on loopback over the model-free FakeBackend
(word-level tokens, so the tool's word prompts have exact counts there too). Counts, usage and
cached tokens, the multi-turn history, --compare, errors. No timing is asserted."""
from __future__ import annotations

import json

import pytest

from services.loadgen.cli import main, run_bench
from services.loadgen.config import BenchConfig
from services.loadgen.words import FALLBACK_WORDS, WordPool
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.gateway_thread import GatewayThread

POOL = WordPool(tuple(FALLBACK_WORDS), False, "none")
SMALL = dict(input_len=20, output_len=6, gsp_groups=2, gsp_prompts_per_group=3, gsp_system_prompt_len=30,
             gsp_question_len=4, turns=3, progress=False, warmup_requests=0, tokenizer="none")


@pytest.fixture
def gateway():
    with GatewayThread(FakeBackend()) as gw:
        yield gw


def test_cli_random_run_counts_tokens_and_writes_json_and_plot(gateway, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["--base-url", gateway.url, "--dataset", "random", "--num-prompts", "8", "--input-len", "20",
               "--output-len", "6", "--ignore-eos", "--max-concurrency", "3", "--request-rate", "200",
               "--slo", "ttft:60000,tpot:60000", "--tokenizer", "none", "--no-progress",
               "--output-file", str(out)] + (["--plot", str(png)] if _has_matplotlib() else []))
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["runs"][0]["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (8, 8, 0)
    assert s["output_tokens"] == 48 and s["input_tokens"] == 8 * 20  # usage: exact for the word-level model
    assert s["usage_reported"] == 8 and s["prefix_hit_rate"] == 0.0 and s["goodput"] is not None
    warmup, *calls = gateway.backend.calls  # one unmeasured warm-up request first (the default)
    assert warmup.sampling.max_new_tokens == 4
    assert len(calls) == 8 and all(c.sampling.ignore_eos and c.sampling.max_new_tokens == 6 for c in calls)
    assert "output throughput (tok/s)" in capsys.readouterr().out
    if _has_matplotlib():
        assert png.read_bytes()[:4] == b"\x89PNG"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_multi_turn_resends_the_history_with_the_servers_answers(gateway):
    doc, _ = run_bench(BenchConfig(base_url=gateway.url, dataset="multi-turn", num_prompts=2, **SMALL), POOL)
    assert doc["runs"][0]["summary"]["completed"] == 6
    by_conv: dict[str, list] = {}
    for c in gateway.backend.calls:
        by_conv.setdefault(c.messages[0]["content"], []).append(c.messages)
    assert len(by_conv) == 2
    for msgs in by_conv.values():
        assert [len(m) for m in msgs] == [1, 3, 5]
        assert msgs[1][1]["role"] == "assistant" and msgs[1][1]["content"]  # the server's actual answer
        assert msgs[2][:3] == msgs[1]


def test_compare_runs_the_same_prompts_on_both_and_cached_tokens_flow(gateway):
    # B is the same server: in one round it runs after A, so every prompt is a repeat there
    # (the fake backend serves len - 1 cached tokens for a prompt it has seen).
    doc, servers = run_bench(BenchConfig(base_url=gateway.url, compare=gateway.url, compare_rounds=1,
                                         dataset="generated-shared-prefix", max_concurrency=2, **SMALL), POOL)
    a, b = (r["summary"] for r in doc["runs"])
    assert a["completed"] == b["completed"] == 6
    assert a["prefix_hit_rate"] == 0.0 and b["prefix_hit_rate"] == pytest.approx((34 - 1) / 34)
    assert doc["ratios"]["output_throughput"]["b_over_a"] is not None
    # Same prompt set on both; with two in flight the backend may see a pair in either order.
    prompts = [c.text for c in gateway.backend.calls]
    assert len(prompts) == 12 and len(set(prompts[:6])) == 6
    assert sorted(prompts[:6]) == sorted(prompts[6:])


def test_server_errors_are_counted_never_raised():
    with GatewayThread(FakeBackend(queue_full=True)) as gw:
        doc, _ = run_bench(BenchConfig(base_url=gw.url, dataset="random", num_prompts=4, **SMALL), POOL)
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (0, 4) and list(s["errors"])[0].startswith("HTTP 503")
    with GatewayThread(FakeBackend(fail_after_tokens=2)) as gw:
        doc, _ = run_bench(BenchConfig(base_url=gw.url, dataset="multi-turn", num_prompts=2, **SMALL), POOL)
    s = doc["runs"][0]["summary"]
    assert s["failed"] == 6 and any("not sent" in e for e in s["errors"])  # later turns of a broken chat


def test_an_unreachable_server_is_a_clean_exit(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", "--tokenizer", "none", "--no-progress"]) == 1
    assert "/v1/models" in capsys.readouterr().err
