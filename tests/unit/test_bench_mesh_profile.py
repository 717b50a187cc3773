"""bench/mesh_profile.py's pure parts: the phase clock's exclusive accounting and prefill/decode
split (bench/phase_timers.py), the /proc parsers (bench/proc_cpu.py), and the two tables' rows."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import mesh_profile  # noqa: E402
import phase_timers  # noqa: E402
import proc_cpu  # noqa: E402
from phase_timers import PhaseClock  # noqa: E402


class FakeClock:
    """phase_timers' perf_counter: time passes only when busy() says so, so the sums are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def busy(self, seconds: float) -> None:
        self.now += seconds


def test_clock_counts_exclusive_time_and_splits_matmuls_by_the_steps_tokens(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(phase_timers, "time", fake)
    clock = PhaseClock()
    matmul = clock.wrap("matmul", lambda: fake.busy(0.02))
    sample = clock.wrap("sampling", lambda: fake.busy(0.01))

    def execute(runner, plan):
        fake.busy(0.01)
        matmul()
        sample()
    step = clock.wrap_step(execute)
    # one prefill chunk of 3 tokens and one decode row: 3/4 of the matmul time is prefill's
    plan = SimpleNamespace(items=[SimpleNamespace(input_ids=[1, 2, 3], verify=False),
                                  SimpleNamespace(input_ids=[4], verify=False)])
    step(None, plan)
    s = clock.snapshot()
    assert s["inclusive"] == pytest.approx({"step": 0.04, "matmul": 0.02, "sampling": 0.01})
    # exclusive: the step's own time excludes the matmul and sampling inside it; they add up to the step's
    assert s["seconds"] == pytest.approx({"step": 0.01, "prefill_matmul": 0.015, "decode_matmul": 0.005,
                                          "sampling": 0.01})
    assert s["counters"] == {"steps": 1, "steps_with_prefill": 1, "prefill_tokens": 3, "decode_tokens": 1}
    assert s["calls"] == {"matmul": 1, "sampling": 1, "step": 1}


def test_a_verify_item_counts_as_decode():
    clock = PhaseClock()
    clock.wrap_step(lambda runner, plan: None)(None, SimpleNamespace(
        items=[SimpleNamespace(input_ids=[1, 2, 3], verify=True)]))
    assert clock.counters["prefill_tokens"] == 0 and clock.counters["decode_tokens"] == 3


def test_proc_parsers():
    line = "4242 (python -m (x)) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3"
    ppid, cpu = proc_cpu.parse_pid_stat(line)
    assert ppid == 17 and cpu == pytest.approx(300 / proc_cpu.TICKS_PER_S)
    busy_s, idle_s = proc_cpu.parse_machine_stat("cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert busy_s == pytest.approx(170 / proc_cpu.TICKS_PER_S) and idle_s == pytest.approx(820 / proc_cpu.TICKS_PER_S)
    assert proc_cpu.service_name(b"/v/python\0-m\0services.cli\0serve\0worker\0--port\0") == "worker"
    assert proc_cpu.service_name(b"/v/python\0-m\0services.cli\0up\0") is None


def test_worker_rows_add_up_to_the_wall_time():
    before = {"seconds": {"decode_matmul": 1.0, "attention": 0.5}, "inclusive": {"rpc": 2.0}}
    after = {"seconds": {"decode_matmul": 4.0, "attention": 1.5, "prefill_matmul": 2.0, "rpc": 0.25},
             "inclusive": {"rpc": 9.0}}
    rows = dict(mesh_profile.worker_rows(before, after, wall_s=10.0))
    assert rows["decode matmuls"] == 3.0 and rows["prefill matmuls"] == 2.0 and rows["sampling"] == 0.0
    assert rows["between steps (worker waits for a plan)"] == pytest.approx(3.0)  # 10 s wall, 7 s in steps


def test_process_rows_add_up_to_the_machines_capacity():
    rows = mesh_profile.process_rows({"gateway": 1.0, "worker": 10.0}, own_s=0.5, machine_busy_s=15.0,
                                     machine_idle_s=5.0)
    assert rows[0] == ("worker", 10.0)
    d = dict(rows)
    assert d["other processes"] == pytest.approx(3.5) and sum(d.values()) == pytest.approx(20.0)
    text = mesh_profile.format_rows("t", rows, 20.0, "cpu s")
    assert "50.0%" in text and "machine idle" in text
