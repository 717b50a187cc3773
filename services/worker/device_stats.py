"""Where a step's forward time goes on the device, for /metrics.

launch: the host's time issuing the forward (on the CPU the ops run as they are issued, so
this is the whole forward; on CUDA it is the Python and kernel-launch cost, or one graph
replay). device: the GPU's own time for the forward, from CUDA events read once they have
completed (never waited for: the step loop's overlap must not sync); 0 on the CPU. A step
whose launch exceeds its device time is launch-bound, which CUDA graphs remove.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class DeviceStats:
    device: torch.device = torch.device("cpu")  # the worker's: CUDA events are recorded only there
    launch_seconds: float = 0.0  # summed over steps
    device_seconds: float = 0.0  # summed over the forwards whose events have completed
    graph_replays: int = 0  # decode steps run as a captured CUDA graph
    eager_steps: int = 0  # steps whose forward ran op by op (or as one CPU call)
    graph_capture_seconds: float = 0.0  # capturing every bucket's graph, at start
    _events: list = field(default_factory=list)  # (start, end) CUDA events not read yet

    def timed(self, forward: Callable[[], T], replayed: bool = False) -> T:
        """Run forward() (it issues the step's kernels), counting its launch and, on CUDA, its
        device time; returns its result. A forward that returns None declined the step (a
        one-call path that does not take it): nothing is counted."""
        self._read_completed()
        start = end = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        if out is None:
            return out
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        self.launch_seconds += t1 - t0
        if replayed:
            self.graph_replays += 1
        else:
            self.eager_steps += 1
        return out

    def _read_completed(self) -> None:
        while self._events and self._events[0][1].query():
            start, end = self._events.pop(0)
            self.device_seconds += start.elapsed_time(end) / 1e3

    def metrics(self) -> dict[str, tuple[str, str, float]]:
        """name → (kind, help, value), the worker's LiveCollector form."""
        self._read_completed()
        return {
            "worker_step_launch_seconds": ("counter", "host time issuing the steps' forwards (the whole "
                                           "forward on CPU; kernel launches or a graph replay on CUDA)",
                                           self.launch_seconds),
            "worker_step_device_seconds": ("counter", "device time of the steps' forwards (CUDA events; 0 on CPU)",
                                           self.device_seconds),
            "worker_cuda_graph_replays": ("counter", "steps run as a captured CUDA graph", self.graph_replays),
            "worker_eager_steps": ("counter", "steps whose forward ran op by op or as one CPU call",
                                   self.eager_steps),
            "worker_cuda_graph_capture_seconds": ("gauge", "time spent capturing the decode graphs at start",
                                                  self.graph_capture_seconds),
        }
