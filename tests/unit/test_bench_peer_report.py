"""bench/peer_report.py: issue 22's must-show ratios (against peers and the machine's limits) and
the CPU record, on made-up results."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer_report  # noqa: E402


def lat(v: float) -> dict:
    return {"mean": v, "median": v, "p90": v, "p99": v}


RESULTS = {
    "radixmesh": {"single": {"itl_ms": lat(8.0)}, "throughput": {"output_throughput": 1200.0},
                  "shared-prefix": {"e2e_ms": lat(1000.0)}},
    "llama-server": {"single": {"itl_ms": lat(8.0)}, "throughput": {"output_throughput": 100.0}},
    "vllm": {"throughput": {"output_throughput": 400.0}, "shared-prefix": {"e2e_ms": lat(3000.0)}},
}
LIMITS = {"linear_only": {"tok_s": 2400.0}, "batch1_floor_ms": 2.0}


def by_label(rows: list[dict]) -> dict[str, dict]:
    return {r["ratio"]: r for r in rows}


def test_ratios_against_peers_and_their_verdicts():
    rows = by_label(peer_report.must_show(RESULTS, LIMITS))
    itl = rows["single-stream ITL p50 / llama-server"]
    assert itl["value"] == pytest.approx(1.0) and itl["verdict"] == "FAIL" and itl["target"] == "<= 0.8"
    assert rows["64-concurrent tok/s / vLLM"]["value"] == pytest.approx(3.0)
    assert rows["64-concurrent tok/s / vLLM"]["verdict"] == "PASS"
    assert rows["64-concurrent tok/s / llama-server"]["value"] == pytest.approx(12.0)
    shared = rows["shared-prefix e2e mean / vLLM"]
    assert shared["value"] == pytest.approx(1 / 3) and shared["verdict"] == "PASS"


def test_ratios_to_the_machine_limits_throughput_as_a_fraction_latency_as_a_multiple():
    rows = by_label(peer_report.must_show(RESULTS, LIMITS))
    lin = rows["64-concurrent tok/s / bf16 linear-only tok/s at batch 64"]
    assert lin["value"] == pytest.approx(0.5) and lin["verdict"] == "FAIL"  # 1200 of 2400, target >= 0.6
    bw = rows["single-stream ITL p50 / batch-1 weight-read floor (issue 41)"]
    assert bw["value"] == pytest.approx(4.0) and bw["verdict"] == "FAIL" and bw["target"] == "<= 1.4"  # 8 ms / 2 ms


def test_missing_peer_or_limit_is_not_applicable():
    rows = by_label(peer_report.must_show({"radixmesh": RESULTS["radixmesh"]}, None))
    assert all(r["value"] is None and r["verdict"] == "n/a" for r in rows.values())
    text = peer_report.format_must_show(list(rows.values()))
    assert "n/a" in text and "64-concurrent tok/s / vLLM" in text


def test_table_has_a_vllm_column_and_the_e2e_row():
    rows = peer_report.table_rows(RESULTS)
    e2e = next(r for r in rows if r["workload"] == "shared-prefix" and r["metric"] == "e2e mean (ms)")
    assert e2e["radixmesh/vllm"] == pytest.approx(1 / 3) and e2e["radixmesh/llama-server"] is None
    assert "radixmesh/vllm" in peer_report.format_table(rows).splitlines()[0]


def test_cpuinfo_names_the_model_and_the_flags_that_matter():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\n"
            "processor\t: 1\nmodel name\t: something else\n")
    rec = peer_report.parse_cpuinfo(text)
    assert rec["model_name"] == "AMD EPYC 9R14" and rec["vendor"] == "AuthenticAMD"
    assert rec["family_model"] == "25/17"
    assert rec["flags"]["avx512_bf16"] and not rec["flags"]["avx512_fp16"] and not rec["flags"]["amx_tile"]
