"""One OpenMP team per process: torch's parallel ops stay on one thread.

libgomp keeps a team of threads for every thread that has run a parallel region, for as long
as that thread lives. Between regions a team's idle threads spin, so the next region starts
in about a microsecond, but only while the threads libgomp manages do not outnumber the CPUs;
past that it spins ~100 times and sleeps on a futex, and every region then pays a wake-up of
~70 us. On 2 cores a second team anywhere in the process is enough: once the thread that
loaded the model has run one parallel op, a batch-64 decode step on the step thread went from
58 to 80 ms (element-wise ops 5x slower, linears 1.5x), and the Engine's offline throughput
from 646 to 528 tok/s (docs/benchmarks.md, issue 22). The spin counts are not configurable
(GOMP_SPINCOUNT and OMP_WAIT_POLICY leave the throttled count at 100-1000).

So the thread that steps the model also builds it (the worker service's step executor, the
Engine's), and work that must run torch elsewhere runs on a thread of its own that exits
when done (`on_own_thread`), taking its team with it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread, joined before returning: any OpenMP team its
    torch ops started is gone with the thread. Exceptions propagate."""
    with ThreadPoolExecutor(1, thread_name_prefix="omp-scratch") as pool:
        return pool.submit(fn, *args, **kwargs).result()
