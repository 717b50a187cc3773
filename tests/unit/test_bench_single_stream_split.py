"""bench/single_stream_split.py's arithmetic, on a recorded mesh_profile result: phases and each
process's CPU per output token, and the table's ratios to the floor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import single_stream_split as split  # noqa: E402

MESH = {  # 2 requests x 100 tokens: 200 output tokens
    "workload": {"requests": 2, "output_len": 100},
    "itl_ms": {"median": 7.0, "mean": 7.2},
    "worker": [("one-call decode steps (matmuls + attention)", 1.2), ("sampling", 0.02),
               ("runner Python (admission, layout, glue)", 0.04), ("between steps (worker waits for a plan)", 0.1)],
    "processes": [("worker", 2.4), ("scheduler", 0.12), ("gateway", 0.08), ("machine idle", 0.2)],
}


def test_mesh_split_is_per_output_token():
    mesh = split.mesh_split(MESH)
    assert mesh["tokens"] == 200
    assert mesh["phases_ms"]["one_call"] == pytest.approx(6.0)
    assert mesh["phases_ms"]["sampling"] == pytest.approx(0.1)
    assert mesh["phases_ms"]["attention"] == 0.0  # absent phases are zero, not missing
    assert mesh["between_steps_ms"] == pytest.approx(0.5)
    assert mesh["cpu_ms"]["scheduler"] == pytest.approx(0.6) and mesh["cpu_ms"]["worker"] == pytest.approx(12.0)


def test_table_names_the_floor_multiples():
    limits = {"batch1_floor_ms": 3.5, "batch1_weight_bytes": 111.5e6, "memory": {"read_gb_s": 31.9}}
    inproc = {"itl_ms": {"median": 5.6, "mean": 5.8}, "linears_only_ms": 4.2, "int8_activations": True,
              "decode_tokens": 190, "phases_ms": dict.fromkeys(split.STEP_PHASES, 0.0) | {"one_call": 5.0}}
    text = split.table(limits, inproc, split.mesh_split(MESH))
    assert "1.60x / 2.00x the floor" in text  # 5.6 and 7.0 over 3.5
    assert "1.20x the floor" in text          # the linears
    assert "activations on the blocks: int8" in text
    row = next(line for line in text.splitlines() if line.startswith("  of it: all but the linears"))
    assert "0.800" in row and "1.800" in row  # the one-call step minus its linears, both sides
    assert "of it: attention" not in text  # no split recorded: no split rows


def test_the_one_call_steps_own_timers_split_it_per_step():
    split_ms = split.one_call_split({"linears": 0.33, "lm_head": 0.1, "attention": 0.05, "rope_kv_write": 0.002,
                                     "elementwise": 0.004, "all_reduce": 0.0, "setup": 0.001, "steps": 100})
    assert split_ms["linears"] == pytest.approx(3.3) and split_ms["attention"] == pytest.approx(0.5)
    assert "steps" not in split_ms
    limits = {"batch1_floor_ms": 3.5, "batch1_weight_bytes": 111.5e6, "memory": {"read_gb_s": 31.9}}
    inproc = {"itl_ms": {"median": 5.6, "mean": 5.8}, "linears_only_ms": 4.2, "int8_activations": True,
              "decode_tokens": 190, "one_call_split_ms": split_ms,
              "phases_ms": dict.fromkeys(split.STEP_PHASES, 0.0) | {"one_call": 5.0}}
    lines = split.table(limits, inproc, split.mesh_split(MESH)).splitlines()
    attention = next(line for line in lines if line.startswith("  of it: attention"))
    assert "0.500" in attention
    assert not any("all-reduce" in line for line in lines)  # a group of one: no all-reduce row
