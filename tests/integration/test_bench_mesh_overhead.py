"""bench/mesh_overhead.py's measurement on recorded streams (no model, no mesh): SSE parsing,
ITL / TTFT / TPOT / throughput, the ratios and the table."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "mesh_overhead.py"
spec = importlib.util.spec_from_file_location("mesh_overhead", PATH)
bench = sys.modules["mesh_overhead"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(bench)


def sse(t: float, obj) -> tuple[float, bytes]:
    return t, b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


def chunk(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


# A recorded stream of 5 tokens: sent at 10.0, text at 10.2, 10.25, 10.3 (two tokens: the
# detokenizer held one back), 10.4; then the finish, the usage chunk and [DONE].
RECORDED = [
    sse(10.2, chunk(" The")), (10.2, b"\n"),
    sse(10.25, chunk(" sky")), (10.25, b"\n"),
    sse(10.3, chunk(" is \u2014")), (10.3, b"\n"),
    sse(10.4, chunk(" blue")), (10.4, b"\n"),
    sse(10.41, chunk("", "length")), (10.41, b"\n"),
    sse(10.41, {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5,
                                                                      "total_tokens": 9}}),
    sse(10.42, b"[DONE]"),
]


def test_an_sse_stream_becomes_a_record():
    rec = bench.sse_record(10.0, RECORDED)
    assert rec.events == [10.2, 10.25, 10.3, 10.4]  # the finish event has no text: not a token event
    assert rec.tokens == 5 and rec.text == " The sky is \u2014 blue"
    assert bench.itl_samples(rec.events) == pytest.approx([0.05, 0.05, 0.1])
    with pytest.raises(RuntimeError, match="error event"):
        bench.sse_record(0.0, [sse(1.0, chunk("a")), sse(1.1, {"error": {"message": "worker died"}})])
    with pytest.raises(RuntimeError, match=r"without \[DONE\]"):
        bench.sse_record(0.0, RECORDED[:-1])


def test_chunks_become_lines_timed_by_the_chunk_that_completed_them():
    chunks = [(1.0, b"data: a\n\nda"), (2.0, b"ta: b\n"), (3.0, b"\ndata: [DONE]")]
    assert bench.timed_lines(chunks) == [(1.0, b"data: a"), (1.0, b""), (2.0, b"data: b"), (3.0, b""),
                                         (3.0, b"data: [DONE]")]


def test_percentiles_match_numpys_linear_rule():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert bench.percentile([7.0], 90) == 7.0 and math.isnan(bench.percentile([], 50))


def test_summary_ratios_and_table():
    a = bench.sse_record(10.0, RECORDED)
    b = bench.RequestRecord(sent=0.0, events=[0.5, 0.6, 0.7], tokens=3)
    s = bench.summarize([a, b], wall_s=2.0)
    # ITL samples pooled: 0.05, 0.05, 0.1 (a) and 0.1, 0.1 (b)
    assert s["itl_samples"] == 5
    assert s["itl_mean_ms"] == pytest.approx(80.0) and s["itl_median_ms"] == pytest.approx(100.0)
    assert s["itl_p90_ms"] == pytest.approx(100.0)
    assert s["ttft_mean_ms"] == pytest.approx((200.0 + 500.0) / 2)
    assert s["tpot_mean_ms"] == pytest.approx((200.0 / 4 + 200.0 / 2) / 2)  # (last - first) / (tokens - 1)
    assert s["output_tok_s"] == pytest.approx(8 / 2.0) and s["output_tokens"] == 8

    slower = {**s, "itl_mean_ms": s["itl_mean_ms"] * 1.1, "output_tok_s": s["output_tok_s"] / 1.1}
    q = bench.ratios(s, slower)
    assert q["itl_mean_ms"] == pytest.approx(1.1) and q["output_tok_s"] == pytest.approx(1 / 1.1)
    table = bench.format_table({1: {"in_process": s, "mesh": slower, "ratio": q},
                                16: {"in_process": s, "mesh": {**s, "itl_mean_ms": 100.0},
                                     "ratio": bench.ratios(s, {**s, "itl_mean_ms": 100.0})}})
    assert "mesh/in-process" in table and "1.100x" in table
    assert "c=1: mesh ITL mean 1.100x in-process (MISSES <= 1.05x)" in table
    assert "c=16: mesh throughput 1.000x in-process (meets >= 0.95x)" in table


async def test_run_concurrent_bounds_the_requests_in_flight():
    live, peak = 0, 0

    async def one(ids):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.001)
        live -= 1
        return bench.RequestRecord(sent=0.0, tokens=len(ids))

    records, wall = await bench.run_concurrent([[1]] * 10 + [[1, 2]], 3, one)
    assert peak == 3 and wall > 0 and [r.tokens for r in records] == [1] * 10 + [2]
