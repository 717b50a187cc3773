"""The thread that leads the one-call decode steps: its own CPU (`--lead-cpu`, opt-in) and a
higher priority during the steps (`--lead-nice`, on by default where permitted).

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

# The CPUs this process may use, read at the first import (the worker's config imports this
# module at start-up, before anything is pinned). Later a thread's own affinity no longer says
# that: the worker's threads are moved off the lead CPU, and a weight update builds its new
# config and runner on one of them.
PROCESS_CPUS = frozenset(os.sched_getaffinity(0))


def other_cpus(lead: int, allowed: set[int] | None = None) -> set[int]:
    """The CPUs besides `lead` this process may use; ValueError if that leaves none or lead is not one."""
    allowed = set(PROCESS_CPUS) if allowed is None else allowed
    if lead not in allowed:
        raise ValueError(f"--lead-cpu {lead} is not one of this process's CPUs {sorted(allowed)}")
    if len(allowed) < 2:
        raise ValueError("--lead-cpu needs at least 2 CPUs")
    return allowed - {lead}


class LeadCpu:
    def __init__(self, lead: int) -> None:
        self.lead = lead
        self.allowed = set(PROCESS_CPUS)
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



class LeadPriority:
    """The step's thread at a higher priority (a negative nice value) during one-call decode
    steps only, so the scheduler rarely preempts it for the mesh's other threads; batched
    steps keep the ordinary priority. Raising a priority needs CAP_SYS_NICE (or RLIMIT_NICE):
    without it `usable` is False and the steps run as they are."""

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self.usable = nice < 0 and self._try()

    def _try(self) -> bool:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, self.nice)
        except PermissionError:
            log.warning("--lead-nice %d needs CAP_SYS_NICE: decode steps keep the ordinary priority", self.nice)
            return False
        os.setpriority(os.PRIO_PROCESS, tid, before)
        return True

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """The calling thread at the lead's nice value for the block, at its own after it."""
        if not self.usable:
            yield
            return
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, self.nice)
        try:
            yield
        finally:
            os.setpriority(os.PRIO_PROCESS, tid, before)
