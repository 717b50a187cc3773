"""--lead-cpu / radixmesh up --pin-lead-cpu (services/worker/lead_cpu.py): the decode step's
lead thread on its CPU during the step only, the step team's helpers and the other services
off it, and clear errors for CPUs this process cannot use."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from services.launcher.children import _die_with_parent
from services.launcher.up import Mesh, UpConfig
from services.worker.config import WorkerConfig
from services.worker import lead_cpu
from services.worker.lead_cpu import other_cpus
from services.worker.model_runner import ModelRunner
from tests.unit.test_decode_stack import _decode

ALLOWED = os.sched_getaffinity(0)
needs_two = pytest.mark.skipif(len(ALLOWED) < 2 or torch.get_num_threads() < 2, reason="needs 2 CPUs and threads")


def test_other_cpus_and_bad_choices():
    assert other_cpus(0, {0, 1, 2}) == {1, 2}
    with pytest.raises(ValueError, match="not one of this process's CPUs"):
        other_cpus(5, {0, 1})
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        other_cpus(0, {0})
    with pytest.raises(ValueError, match="not one of"):
        WorkerConfig(lead_cpu=max(ALLOWED) + 1)
    with pytest.raises(ValueError, match="one replica"):
        UpConfig(pin_lead_cpu=str(min(ALLOWED)), replicas=2)
    with pytest.raises(ValueError, match="auto, off or a CPU number"):
        UpConfig(pin_lead_cpu="first")


@needs_two
def test_the_launcher_starts_every_service_but_the_worker_off_the_lead_cpu():
    lead = min(ALLOWED)
    mesh = Mesh(UpConfig(pin_lead_cpu=str(lead)), {"worker": []})
    assert mesh._cpus("worker") is None
    assert mesh._cpus("tokenizer") == mesh._cpus("gateway") == ALLOWED - {lead}
    assert "--lead-cpu" in mesh._argv("worker", []) and mesh._argv("worker", [])[-1] == str(lead)
    assert Mesh(UpConfig(pin_lead_cpu="off"), {"worker": []})._cpus("tokenizer") is None
    # The child's own affinity, set between fork and exec (its threads all inherit it).
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         preexec_fn=_die_with_parent(os.getpid(), ALLOWED - {lead}), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str(sorted(ALLOWED - {lead}))


def test_auto_keeps_the_last_cpu_for_one_replica_only():
    """The default: one replica on 2+ CPUs keeps the last CPU for the lead; more replicas (or
    one CPU) pin nothing, and off turns it off."""
    auto = UpConfig()
    assert auto.pin_lead_cpu == "auto"
    assert auto.lead_cpu == (max(ALLOWED) if len(ALLOWED) >= 2 else None)
    assert UpConfig(replicas=2).lead_cpu is None
    assert UpConfig(pin_lead_cpu="off").lead_cpu is None
    if len(ALLOWED) >= 2:
        mesh = Mesh(auto, {"worker": []})
        assert mesh._argv("worker", [])[-2:] == ["--lead-cpu", str(max(ALLOWED))]
        assert mesh._cpus("gateway") == ALLOWED - {max(ALLOWED)}
        assert "--lead-cpu" not in Mesh(UpConfig(replicas=2), {"worker": []})._argv("worker", [])


@needs_two
def test_a_thread_moved_off_the_lead_cpu_still_builds_a_config_that_keeps_it():
    """A weight update builds its new WorkerConfig and runner on one of the worker's threads,
    which the lead CPU has moved off that CPU: the choice is checked against the process's
    CPUs, not that thread's."""
    lead = max(ALLOWED)
    result: dict = {}

    def on_a_moved_thread() -> None:
        os.sched_setaffinity(0, ALLOWED - {lead})
        try:
            result["config"] = WorkerConfig(lead_cpu=lead)
            result["allowed"] = lead_cpu.LeadCpu(lead).allowed
        except Exception as exc:  # reported below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=on_a_moved_thread)
    thread.start()
    thread.join(timeout=30)
    assert "error" not in result, result.get("error")
    assert result["config"].lead_cpu == lead and result["allowed"] == set(ALLOWED)


def _thread_cpus() -> dict[int, tuple[str, set[int]]]:
    """Each live thread's name and CPUs; a thread that ends while it is read (one a test just
    joined may still be leaving) is left out."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = (f.read().strip(), os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


@needs_two
def test_the_step_runs_on_the_lead_cpu_and_its_helpers_elsewhere(checkpoint, monkeypatch):
    lead = min(ALLOWED)
    before = set(_thread_cpus())
    runner = ModelRunner(WorkerConfig(dtype="bfloat16", kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2,
                                      lead_cpu=lead), checkpoint)
    seen, real = [], runner.model.decode_step

    def spy(*args):
        seen.append(os.sched_getaffinity(0))
        return real(*args)

    monkeypatch.setattr(runner.model, "decode_step", spy)
    _decode(runner, ["a"], 2)  # a prefill (not pinned), then two one-call decode steps
    assert seen == [{lead}, {lead}]
    assert os.sched_getaffinity(0) == ALLOWED  # every CPU again after the step
    helpers = [cpus for tid, (name, cpus) in _thread_cpus().items() if tid not in before and name == "rm-team-1"]
    assert helpers == [ALLOWED - {lead}]


def test_the_step_runs_at_the_lead_priority_and_gives_it_back(checkpoint, monkeypatch):
    """--lead-nice: a higher priority during one-call decode steps only (where permitted)."""
    runner = ModelRunner(WorkerConfig(dtype="bfloat16", kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2,
                                      lead_nice=-5), checkpoint)
    if not runner.backend.lead_priority.usable:
        pytest.skip("no CAP_SYS_NICE here")
    tid = threading.get_native_id()
    own = os.getpriority(os.PRIO_PROCESS, tid)
    seen, real = [], runner.model.decode_step

    def spy(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        return real(*args)

    monkeypatch.setattr(runner.model, "decode_step", spy)
    _decode(runner, ["a"], 2)
    assert seen == [-5, -5] and os.getpriority(os.PRIO_PROCESS, tid) == own
    with pytest.raises(ValueError, match="lead-nice"):
        WorkerConfig(lead_nice=5)


def test_without_cap_sys_nice_the_lead_priority_is_refused_and_steps_run_as_they_are(monkeypatch, caplog):
    """The fallback behind the test above, forced: where raising a priority is not permitted (CI
    containers often lack CAP_SYS_NICE), LeadPriority says so once and `leading` changes nothing."""
    def refuse(which, who, prio):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(lead_cpu.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=lead_cpu.__name__):
        priority = lead_cpu.LeadPriority(-5)
    assert priority.usable is False
    assert any("needs CAP_SYS_NICE" in r.getMessage() for r in caplog.records)
    tid = threading.get_native_id()
    own = os.getpriority(os.PRIO_PROCESS, tid)
    with priority.leading():  # would raise PermissionError if it tried
        assert os.getpriority(os.PRIO_PROCESS, tid) == own


def _helper_priorities(before: set[int]) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, tid) for tid, (name, _) in _thread_cpus().items()
            if tid not in before and name == "rm-team-1"]


@needs_two
def test_the_step_team_helpers_keep_their_own_priority_not_the_leads(checkpoint):
    """--step-team-helper-nice: a helper made during a step (at the lead's raised priority) sets
    its own nice value; it used to inherit the lead's -N and then outrank the mesh's services."""
    before = set(_thread_cpus())
    runner = ModelRunner(WorkerConfig(dtype="bfloat16", kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2,
                                      lead_nice=-5), checkpoint)
    if not runner.backend.lead_priority.usable:
        pytest.skip("no CAP_SYS_NICE here: the lead never runs above the helpers")
    _decode(runner, ["a"], 2)
    assert _helper_priorities(before) == [0]
    runner.model.decode_stack.set_helper_nice(7)  # a new team at the next step
    before = set(_thread_cpus())
    _decode(runner, ["b"], 2)
    assert _helper_priorities(before) == [7]
    with pytest.raises(ValueError, match="step-team-helper-nice"):
        WorkerConfig(step_team_helper_nice=20)
