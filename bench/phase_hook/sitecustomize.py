"""Loaded by Python at start-up in every process whose PYTHONPATH holds this folder
(bench/mesh_profile.py starts `radixmesh up` so): in the mesh's worker, when
RADIXMESH_PHASE_TIMERS names a file, puts in bench/phase_timers.py's per-phase timers and
writes their totals to that file. Any other process, or no variable: nothing happens."""
import os
import sys


def _is_worker() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a == b"serve" and b == b"worker" for a, b in zip(argv, argv[1:]))


def _start(path: str) -> None:
    bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, bench)
    try:
        import phase_timers
    finally:
        sys.path.remove(bench)
    clock = phase_timers.PhaseClock()
    phase_timers.install(clock)
    phase_timers.write_snapshots(clock, path)


_path = os.environ.get("RADIXMESH_PHASE_TIMERS")
if _path and _is_worker():
    _start(_path)
