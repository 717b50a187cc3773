"""tests/rss_watch.py: the suite's peak RSS is measured over the process tree and a run over
budget fails, so a leak cannot come back unnoticed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import psutil
from tests.rss_watch import tree_rss_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLDS_256_MB = textwrap.dedent("""
    import time
    HELD = b"\\x01" * (256 << 20)  # touched: resident for the whole module

    def test_holds():
        time.sleep(1.2)  # a few samples while it is held
        assert len(HELD) == 256 << 20
""")


def _run(tmp_path, budget_gib: float) -> subprocess.CompletedProcess:
    (tmp_path / "test_holds.py").write_text(HOLDS_256_MB)
    env = {**os.environ, "RADIXMESH_TEST_RSS_BUDGET_GIB": str(budget_gib), "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.rss_watch",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_holds.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a pytest run in a child process
def test_a_run_over_its_budget_fails_and_names_the_module(tmp_path):
    run = _run(tmp_path, budget_gib=0.2)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert "peak RSS, pytest process" in run.stdout and "OVER" in run.stdout and "test_holds.py" in run.stdout


@pytest.mark.slow  # a pytest run in a child process
def test_a_run_within_its_budget_passes_and_prints_its_peak(tmp_path):
    run = _run(tmp_path, budget_gib=64)
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(l for l in run.stdout.splitlines() if l.startswith("peak RSS, pytest process"))
    assert "OVER" not in line and float(line.split(": ")[1].split()[0]) >= 0.25  # the 256 MB were seen


def test_the_tree_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; x = b'1' * (200 << 20); "
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while tree_rss_bytes(psutil.Process()) - psutil.Process().memory_info().rss < 190 << 20:
            assert time.monotonic() < deadline, "the child's 200 MB never showed in the tree's RSS"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait(timeout=10)
