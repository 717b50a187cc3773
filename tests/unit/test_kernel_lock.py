"""A built CPU kernel loads without torch's build lock: a process killed while holding the lock
(a worker stopped during start-up, as the mesh tests do) left every later load waiting on it,
and a worker waiting there never exits (found in issue 33's lifecycle test)."""
from __future__ import annotations

import os
import subprocess
import sys

from kernels import cpu_build, fused_cpu
from tests.kernel_builds import built

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_built_kernel_loads_past_a_lock_left_by_a_dead_process():
    built(fused_cpu)  # built and stamped
    lock = os.path.join(cpu_build.build_root(), "fused_cpu", "lock")
    open(lock, "w").close()
    try:
        proc = subprocess.run([sys.executable, "-c", "from kernels import fused_cpu; assert fused_cpu.load() is not None"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        os.remove(lock)
    assert proc.returncode == 0, proc.stderr


def test_a_lock_older_than_any_build_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (0, 0))
    cpu_build._remove_stale_lock(str(lock))
    assert not lock.exists()
    fresh = tmp_path / "fresh"
    fresh.touch()
    cpu_build._remove_stale_lock(str(fresh))  # another process may be building right now
    assert fresh.exists()
