"""radixmesh bench's measurement on recorded SSE streams, with hand-computed expectations."""
from __future__ import annotations

import json
import math

import pytest

from services.loadgen.client import RequestResult, parse_recorded
from services.loadgen.metrics import output_timeline, percentile, summarize


def sse(t: float, obj) -> tuple[float, bytes]:
    return t, b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


def usage(prompt: int, completion: int, cached: int | None) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"object": "text_completion", "choices": [], "usage": u}


# Sent at 10.0; text at 10.2, 10.25, 10.3 (two tokens in one chunk), 10.4; 5 tokens; [DONE] at 10.42.
R1 = [sse(10.2, text_chunk(" The")), (10.2, b"\n"), sse(10.25, text_chunk(" sky")), sse(10.3, text_chunk(" is so")),
      sse(10.4, text_chunk(" blue")), sse(10.41, text_chunk("", "length")), sse(10.41, usage(4, 5, 2)),
      sse(10.42, b"[DONE]")]
# A chat stream: sent at 20.0; content at 20.1 and 20.3 (the role-only first delta has none); [DONE] at 20.3.
R2 = [sse(20.05, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
      sse(20.1, {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
      sse(20.3, {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]}),
      sse(20.3, {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2}}), sse(20.3, b"[DONE]")]


def recorded() -> list[RequestResult]:
    failed = RequestResult(start=30.0, end=30.01, error="HTTP 503: full")
    return [parse_recorded(10.0, R1), parse_recorded(20.0, R2), failed]


def test_a_recorded_stream_gives_ttft_itl_tpot_e2e():
    r1, r2, _ = recorded()
    assert r1.ok and r1.text == " The sky is so blue" and r1.output_tokens == 5
    assert (r1.prompt_tokens, r1.cached_tokens, r1.usage_reported) == (4, 2, True)
    assert r1.ttft == pytest.approx(0.2) and r1.e2e == pytest.approx(0.42)
    assert r1.itl == pytest.approx([0.05, 0.05, 0.1])
    assert r1.tpot == pytest.approx(0.22 / 4)
    assert r2.ok and r2.text == "Hi!" and r2.cached_tokens is None
    assert (r2.ttft, r2.tpot, r2.e2e) == pytest.approx((0.1, 0.2, 0.3))


def test_broken_streams_are_errors_not_exceptions():
    no_done = parse_recorded(0.0, R1[:-1])
    assert not no_done.ok and "[DONE]" in no_done.error
    err = parse_recorded(0.0, [sse(1.0, text_chunk("a")), sse(1.1, {"error": {"message": "worker died"}})])
    assert not err.ok and "worker died" in err.error
    garbage = parse_recorded(0.0, [(1.0, b"data: {not json")])
    assert not garbage.ok
    no_usage = parse_recorded(0.0, [sse(1.0, text_chunk("a")), sse(1.5, text_chunk("b")), sse(1.6, b"[DONE]")])
    assert no_usage.ok and not no_usage.usage_reported and no_usage.output_tokens == 2  # counted events


def test_summary_matches_hand_computed_values():
    s = summarize(recorded(), wall_s=1.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 503: full": 1}
    assert (s["input_tokens"], s["output_tokens"]) == (10, 7)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == \
        pytest.approx((2.0, 7.0, 17.0))
    # ITL pooled: 50, 50, 100, 200 ms
    assert s["itl_ms"] == pytest.approx({"mean": 100.0, "median": 75.0, "p90": 170.0, "p99": 197.0, "n": 4})
    assert s["ttft_ms"] == pytest.approx({"mean": 150.0, "median": 150.0, "p90": 190.0, "p99": 199.0, "n": 2})
    assert s["tpot_ms"]["mean"] == pytest.approx((55.0 + 200.0) / 2)
    assert s["e2e_ms"]["median"] == pytest.approx(360.0)
    assert s["prefix_hit_rate"] == pytest.approx(2 / 4)  # only r1 reported cached tokens
    assert s["goodput"] is None
    assert s["mean_concurrency"] == pytest.approx(0.72)


def test_goodput_counts_requests_meeting_every_bound():
    s = summarize(recorded(), 2.0, {"ttft": 250.0, "tpot": 60.0})  # r1 meets both; r2's TPOT is 200 ms
    assert s["goodput"] == pytest.approx(0.5) and s["good_fraction"] == pytest.approx(1 / 3)
    assert summarize(recorded(), 2.0, {"ttft": 150.0, "tpot": 100.0})["goodput"] == 0.0
    assert summarize(recorded(), 2.0, {"itl": 150.0})["goodput"] == pytest.approx(0.5)  # r2's one gap is 200
    assert summarize(recorded(), 2.0, {"e2e": 1000.0})["goodput"] == pytest.approx(1.0)


def test_percentiles_and_empty_runs():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    s = summarize([], 0.0)
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["mean"]) and s["prefix_hit_rate"] is None


def test_output_timeline_spreads_tokens_over_events():
    r1, r2, _ = recorded()
    points = output_timeline([r1, r2], t0=10.0, bin_s=5.0)
    assert points[0] == (0.0, pytest.approx(5 / 5.0)) and points[-1] == (10.0, pytest.approx(2 / 5.0))
    assert points[1] == (5.0, 0.0)


def speculated(draft: int, accepted: int) -> RequestResult:
    """R1 whose usage reports speculative decoding's counters."""
    u = usage(4, 5, 0)
    u["usage"]["speculative"] = {"verify_steps": 3, "draft_tokens": draft, "accepted_tokens": accepted,
                                 "acceptance_rate": round(accepted / draft, 4)}
    return parse_recorded(10.0, [*R1[:6], sse(10.41, u), R1[-1]])


def test_spec_acceptance_rate_pools_the_requests_that_speculated():
    r = speculated(9, 4)
    assert r.ok and (r.spec_draft_tokens, r.spec_accepted_tokens) == (9, 4)
    plain, other, _ = recorded()
    assert plain.spec_draft_tokens is None and summarize([plain, other], 1.0)["spec_acceptance_rate"] is None
    assert summarize([r, speculated(3, 3), plain], 1.0)["spec_acceptance_rate"] == pytest.approx(7 / 12)
