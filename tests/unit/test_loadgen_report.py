"""radixmesh bench's outputs: comparison ratios, the table, the JSON document, the plot."""
from __future__ import annotations

import json

import pytest

from services.loadgen.client import RequestResult
from services.loadgen.compare import ratios, schedule, slices
from services.loadgen.config import BenchConfig
from services.loadgen.datasets import Conversation, Turn
from services.loadgen.driver import RunOutput
from services.loadgen.report import SCHEMA, document, format_table, request_record


def summary(tput: float, ttft: float, hit: float | None) -> dict:
    lat = {"mean": ttft, "median": ttft, "p90": ttft, "p99": ttft, "n": 3}
    return {"completed": 3, "failed": 0, "errors": {}, "wall_s": 1.0, "request_throughput": tput / 10,
            "output_throughput": tput, "total_token_throughput": 2 * tput, "ttft_ms": lat, "tpot_ms": lat,
            "itl_ms": lat, "e2e_ms": lat, "goodput": None, "prefix_hit_rate": hit}


def test_ratios_are_b_over_a_and_name_the_better_server():
    q = ratios(summary(100.0, 50.0, 0.5), summary(300.0, 25.0, 0.5))
    assert q["output_throughput"] == {"a": 100.0, "b": 300.0, "b_over_a": 3.0, "better": "B"}
    assert q["ttft_ms.p99"]["b_over_a"] == 0.5 and q["ttft_ms.p99"]["better"] == "B"  # lower latency wins
    assert q["prefix_hit_rate"]["better"] == "="
    assert q["goodput"] == {"a": None, "b": None, "b_over_a": None, "better": None}
    worse = ratios(summary(100.0, 50.0, 0.9), summary(50.0, 100.0, 0.1))
    assert worse["output_throughput"]["better"] == "A" and worse["ttft_ms.mean"]["better"] == "A"
    assert worse["prefix_hit_rate"]["b_over_a"] == pytest.approx(0.1 / 0.9)


def test_table_shows_both_columns_the_ratio_and_the_errors():
    a, b = summary(100.0, 50.0, None), summary(300.0, 25.0, None)
    b["failed"], b["errors"] = 1, {"HTTP 503: full": 1}
    text = format_table([("A (x)", a), ("B (y)", b)], ratios(a, b))
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "A", "(x)", "B", "(y)", "B/A", "better"]
    row = next(ln for ln in lines if ln.startswith("output throughput"))
    assert row.split()[-4:] == ["100.0", "300.0", "3.000x", "B"]
    assert "prefix cache hit rate" not in text  # no server reported it
    assert "B (y): 1 x HTTP 503: full" in text
    single = format_table([("A", a)])
    assert "B/A" not in single and "TTFT p99 (ms)" in single


def test_compare_interleaves_slices_abba():
    assert [list(r) for r in slices(10, 4)] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert [list(r) for r in slices(2, 5)] == [[0], [1]]
    convs = [Conversation((Turn(f" w{i}", 1, 1),)) for i in range(6)]
    plan = schedule(convs, [0.0, 1.0, 2.0, 3.0, 4.5, 5.0], rounds=3)
    assert [p[0] for p in plan] == ["A", "B", "B", "A", "A", "B"]
    assert plan[0][1] == plan[1][1] == convs[:2]
    assert plan[2][2] == [0.0, 1.0] and plan[4][2] == [0.0, 0.5]  # arrivals relative to the slice


def test_json_document_is_strict_json_with_the_schema():
    r = RequestResult(start=1.0, end=1.5, events=[1.1, 1.2], ok=True, output_tokens=2, prompt_tokens=3,
                      cached_tokens=0, usage_reported=True, done=True)
    doc = document(BenchConfig(progress=False), {"tokenizer": "none", "exact": False, "words": 10},
                   [{"label": "A", "url": "http://x", "model": "m", "summary": summary(1.0, float("nan"), None),
                     "requests": [request_record(r, t0=1.0)]}])
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    assert back["schema"] == SCHEMA and set(back) == {"schema", "date", "config", "word_pool", "runs", "ratios"}
    assert back["config"]["request_rate"] is None  # inf, written as null
    assert back["runs"][0]["summary"]["ttft_ms"]["mean"] is None
    req = back["runs"][0]["requests"][0]
    assert req["ttft_ms"] == pytest.approx(100.0) and req["itl_ms"] == pytest.approx([100.0])
    assert set(req) >= {"conversation", "turn", "ok", "error", "start_s", "tpot_ms", "e2e_ms", "prompt_tokens",
                        "output_tokens", "cached_tokens"}


def test_plot_writes_a_png(tmp_path):
    import matplotlib  # noqa: F401 (a test extra)
    from services.loadgen.plot import write_plot
    rs = [RequestResult(start=0.0, end=0.2 + i, events=[0.1 + i, 0.15 + i, 0.2 + i], ok=True, output_tokens=3)
          for i in range(4)]
    run = RunOutput(results=rs, t0=0.0, wall_s=4.2)
    path = write_plot(str(tmp_path / "p.png"), [("A", [run]), ("B", [run, run])])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
