"""Where a step's forward time goes on the device, for /metrics.

launch: the host's time issuing the forward (on the CPU the ops run as they are issued, so
this is the whole forward; on CUDA it is the Python and kernel-launch cost, or one graph
replay). device wait: the host then waiting for the device to finish (CUDA only; 0 on the CPU).
A step whose launch is close to its total is launch-bound, which CUDA graphs remove.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class DeviceStats:
    launch_seconds: float = 0.0  # summed over steps
    device_wait_seconds: float = 0.0
    graph_replays: int = 0  # decode steps run as a captured CUDA graph
    eager_steps: int = 0  # steps whose forward ran op by op (or as one CPU call)
    graph_capture_seconds: float = 0.0  # capturing every bucket's graph, at start

    def timed(self, device: torch.device, forward: Callable[[], T], replayed: bool = False) -> T:
        """Run forward() (it issues the step's kernels), counting its launch and the wait for
        the device; returns its result. A forward that returns None declined the step (a
        one-call path that does not take it): nothing is counted."""
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        if out is None:
            return out
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
            self.device_wait_seconds += time.perf_counter() - t1
        self.launch_seconds += t1 - t0
        if replayed:
            self.graph_replays += 1
        else:
            self.eager_steps += 1
        return out

    def metrics(self) -> dict[str, tuple[str, str, float]]:
        """name → (kind, help, value), the worker's LiveCollector form."""
        return {
            "worker_step_launch_seconds": ("counter", "host time issuing the steps' forwards (the whole "
                                           "forward on CPU; kernel launches or a graph replay on CUDA)",
                                           self.launch_seconds),
            "worker_step_device_wait_seconds": ("counter", "host time waiting for the device to finish the "
                                                "steps' forwards (CUDA; 0 on CPU)", self.device_wait_seconds),
            "worker_cuda_graph_replays": ("counter", "steps run as a captured CUDA graph", self.graph_replays),
            "worker_eager_steps": ("counter", "steps whose forward ran op by op or as one CPU call",
                                   self.eager_steps),
            "worker_cuda_graph_capture_seconds": ("gauge", "time spent capturing the decode graphs at start",
                                                  self.graph_capture_seconds),
        }
