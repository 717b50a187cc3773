"""bench/single_stream.py's arithmetic on recorded timings (no model, no mesh): the ceiling's
best and median, pooled ITL, both ratios and the verdict against the 1.3x target."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # single_stream imports mesh_overhead from there
spec = importlib.util.spec_from_file_location("single_stream", BENCH / "single_stream.py")
bench = sys.modules["single_stream"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_report_ratios_and_verdicts():
    ceiling = [0.010, 0.012, 0.011, 0.020]  # best 10 ms, median 11.5 ms
    itl = {"fast": [0.012, 0.012, 0.013, 0.011], "slow": [0.015, 0.014, 0.016, 0.015]}
    r = bench.report(ceiling, itl)
    assert r["ceiling_ms"] == {"best": pytest.approx(10.0), "median": pytest.approx(11.5), "calls": 4}
    fast, slow = r["systems"]["fast"], r["systems"]["slow"]
    assert fast["itl_mean_ms"] == pytest.approx(12.0) and fast["itl_median_ms"] == pytest.approx(12.0)
    assert fast["vs_best"] == pytest.approx(1.2) and fast["vs_median"] == pytest.approx(12.0 / 11.5)
    assert slow["vs_best"] == pytest.approx(1.5) and slow["samples"] == 4
    text = bench.format_report(r)
    assert "best 10.00 ms, median 11.50 ms (4 calls)" in text
    assert "fast: ITL mean is 1.20x the fastest linear-only step (meets <= 1.3x)" in text
    assert "slow: ITL mean is 1.50x the fastest linear-only step (misses <= 1.3x)" in text
