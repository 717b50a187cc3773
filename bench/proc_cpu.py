"""CPU time of processes and of the machine from /proc (Linux), for bench/mesh_profile.py:
a process's user + system seconds (/proc/<pid>/stat), the machine's busy and idle seconds summed
over its cores (/proc/stat), and the children of a process by the service each runs.
The parsers are pure (tests/unit/test_bench_mesh_profile.py)."""
from __future__ import annotations

import os

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def parse_pid_stat(text: str) -> tuple[int, float]:
    """A /proc/<pid>/stat line → (parent pid, user + system CPU seconds of all its threads)."""
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    ppid, utime, stime = int(rest[1]), int(rest[11]), int(rest[12])
    return ppid, (utime + stime) / TICKS_PER_S


def parse_machine_stat(text: str) -> tuple[float, float]:
    """/proc/stat → (busy, idle) CPU seconds summed over every core since boot (idle counts iowait;
    guest time is already inside user)."""
    fields = [int(x) for x in text.splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / TICKS_PER_S, idle / TICKS_PER_S


def service_name(cmdline: bytes) -> str | None:
    """The service a `radixmesh serve <service>` process runs, from its NUL-separated cmdline."""
    argv = cmdline.split(b"\0")
    for a, b in zip(argv, argv[1:]):
        if a == b"serve" and b:
            return b.decode()
    return None


def _read(path: str, mode: str = "r"):
    with open(path, mode) as f:
        return f.read()


def process_cpu_seconds(pid: int) -> float | None:
    try:
        return parse_pid_stat(_read(f"/proc/{pid}/stat"))[1]
    except (OSError, ValueError, IndexError):
        return None  # it exited


def machine_seconds() -> tuple[float, float]:
    return parse_machine_stat(_read("/proc/stat"))


def mesh_children(parent: int) -> dict[str, int]:
    """The `radixmesh serve` children of `parent` → {service name: pid} (a second replica of a
    service gets its pid appended: worker, worker-4242)."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid, _ = parse_pid_stat(_read(f"/proc/{entry}/stat"))
            name = service_name(_read(f"/proc/{entry}/cmdline", "rb")) if ppid == parent else None
        except (OSError, ValueError, IndexError):
            continue
        if name:
            found[name if name not in found else f"{name}-{entry}"] = int(entry)
    return found
