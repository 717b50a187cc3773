"""Per-phase wall timers for the worker's step thread, put in from outside (bench/mesh_profile.py):
the worker's classes are wrapped in place, so services/ carries no profiling code.

Each wrapped call adds its *exclusive* time (its own, minus the wrapped calls inside it) to its
phase, so the phases of one step add up to the step's time. Matmul time is split between
prefill and decode by the step's tokens (a step mixing a 256-token chunk and 40 decode rows
gives 256/296 of its matmul time to prefill): matmul cost grows with the rows.

Phases: rpc (the worker service's step: proto conversion, lock, metrics), step (ModelRunner.execute
outside the rest: admission, layout, Python between ops), prefill_matmul / decode_matmul (every
Linear, LM head included), attention (the backend's prepare and forward), one_call (the C++
one-call decode step of small batches: its matmuls and attention together), elementwise (norms,
RoPE, SiLU), sampling (run_sampler).

In the worker: bench/phase_hook/sitecustomize.py calls install() when RADIXMESH_PHASE_TIMERS
names a file; the totals are written there (JSON) twice a second.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import defaultdict
from typing import Callable

SNAPSHOT_INTERVAL_S = 0.5


class PhaseClock:
    """Exclusive wall time per phase, on any number of threads (a stack per thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)   # exclusive
        self.inclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.counters: dict[str, int] = defaultdict(int)      # steps, prefill/decode tokens
        self.prefill_share = 0.0  # of the step running now: prefill tokens / all its tokens
        self._local = threading.local()

    def _stack(self) -> list[float]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def add(self, phase: str, exclusive: float, inclusive: float) -> None:
        if phase == "matmul":
            self.seconds["prefill_matmul"] += exclusive * self.prefill_share
            self.seconds["decode_matmul"] += exclusive * (1.0 - self.prefill_share)
        else:
            self.seconds[phase] += exclusive
        self.inclusive[phase] += inclusive
        self.calls[phase] += 1

    def wrap(self, phase: str, fn: Callable) -> Callable:
        """fn, timed into `phase`."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack = self._stack()
            stack.append(0.0)  # the time of wrapped calls inside this one
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = stack.pop()
                self.add(phase, elapsed - inner, elapsed)
                if stack:
                    stack[-1] += elapsed
        timed.__phase_timed__ = True
        return timed

    def wrap_step(self, fn: Callable) -> Callable:
        """ModelRunner.execute: counts the step's tokens and sets the prefill share first."""
        timed = self.wrap("step", fn)

        @functools.wraps(fn)
        def step(runner, plan, *args, **kwargs):
            prefill = sum(len(it.input_ids) for it in plan.items if len(it.input_ids) > 1 and not it.verify)
            total = sum(len(it.input_ids) for it in plan.items)
            self.prefill_share = prefill / total if total else 0.0
            self.counters["steps"] += 1
            self.counters["steps_with_prefill"] += prefill > 0
            self.counters["prefill_tokens"] += prefill
            self.counters["decode_tokens"] += total - prefill
            return timed(runner, plan, *args, **kwargs)
        return step

    def snapshot(self) -> dict:
        return {"pid": os.getpid(), "time": time.time(), "seconds": dict(self.seconds),
                "inclusive": dict(self.inclusive), "calls": dict(self.calls), "counters": dict(self.counters)}


def _patch(cls, name: str, wrapper: Callable) -> None:
    fn = cls.__dict__.get(name)
    if fn is not None and not getattr(fn, "__phase_timed__", False):
        setattr(cls, name, wrapper(fn))


def install(clock: PhaseClock) -> None:
    """Wrap the worker's step, linears, attention backends, element-wise ops and sampler."""
    from services.worker import model_runner, service
    from services.worker.attention.cpu_backend import CpuBackend
    from services.worker.attention.torch_backend import TorchAttentionBackend
    from services.worker.model.layer_ops import FusedCpuLayerOps, TorchLayerOps
    from services.worker.model.linear import Linear

    _patch(service.WorkerService, "_step", lambda f: clock.wrap("rpc", f))
    _patch(model_runner.ModelRunner, "execute", clock.wrap_step)
    for name in ("forward", "logits"):
        _patch(Linear, name, lambda f: clock.wrap("matmul", f))
    for backend in (CpuBackend, TorchAttentionBackend):
        for name in ("prepare", "forward"):
            _patch(backend, name, lambda f: clock.wrap("attention", f))
        _patch(backend, "one_call_step", lambda f: clock.wrap("one_call", f))
    for ops in (FusedCpuLayerOps, TorchLayerOps):
        for name in ("add_rms_norm", "rms_norm", "rope_qk", "silu_mul"):
            _patch(ops, name, lambda f: clock.wrap("elementwise", f))
    if not getattr(model_runner.run_sampler, "__phase_timed__", False):
        model_runner.run_sampler = clock.wrap("sampling", model_runner.run_sampler)


def write_snapshots(clock: PhaseClock, path: str, interval_s: float = SNAPSHOT_INTERVAL_S) -> threading.Thread:
    """A daemon thread writing clock.snapshot() to path (atomically) every interval_s."""
    def loop() -> None:
        while True:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(clock.snapshot(), f)
            os.replace(tmp, path)
            time.sleep(interval_s)
    thread = threading.Thread(target=loop, name="phase-timers", daemon=True)
    thread.start()
    return thread


def read_snapshot(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
