"""One CPU kept for the thread that leads the one-call decode steps (`--lead-cpu`).

On a machine with as few cores as the step has threads, every other thread that runs
on the lead's core stops the whole step: the lead runs the step's serial parts and
hands out its parallel loops. A helper's core is the better place for them: the
step team (kernels/cpu/step_team.h) takes a preempted helper's work over, so there
they cost about half their time. With a lead CPU set, the worker runs its decode
steps on that CPU and moves its own other threads off it: the event loop, gRPC's
threads, and the step team's helpers. `radixmesh up --pin-lead-cpu N` also starts the
other services off it. The threads doing other work (a prefill's OpenMP threads) keep
every CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator

log = logging.getLogger(__name__)


def other_cpus(lead: int, allowed: set[int] | None = None) -> set[int]:
    """The CPUs besides `lead` this process may use; ValueError if that leaves none or lead is not one."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    if lead not in allowed:
        raise ValueError(f"--lead-cpu {lead} is not one of this process's CPUs {sorted(allowed)}")
    if len(allowed) < 2:
        raise ValueError("--lead-cpu needs at least 2 CPUs")
    return allowed - {lead}


class LeadCpu:
    def __init__(self, lead: int) -> None:
        self.lead = lead
        self.allowed = set(os.sched_getaffinity(0))
        self.others = other_cpus(lead, self.allowed)

    def move_off(self, thread_ids: Iterable[int]) -> None:
        """Threads that must not run on the lead CPU (ids from /proc/self/task)."""
        for tid in thread_ids:
            try:
                os.sched_setaffinity(tid, self.others)
            except ProcessLookupError:  # ended meanwhile
                pass

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """The calling thread on the lead CPU for the block, on every CPU again after it."""
        os.sched_setaffinity(0, {self.lead})
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.allowed)


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def current_thread_id() -> int:
    return threading.get_native_id()
