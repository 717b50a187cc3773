"""The worker's step thread for one Step stream: plans in, results out, in order.

A result is handed to the event loop when the next step's compute begins
(`ModelRunner.on_compute`) if that next plan is already queued — as it is under
overlapped scheduling — and at once otherwise. The event loop's share of a result
(serializing it, writing it to the stream, reading the next plan) then runs while
the step thread is inside the GIL-free kernels, instead of at the moment the step
thread prepares the next step: there both want the GIL and a core, and on a small
machine that cost ~0.5 ms a step.
"""
from __future__ import annotations

import queue
from typing import Any, Callable

_FINISH = object()  # the scheduler closed the stream: run what is queued, then stop


class StepLoop:
    def __init__(self, runner, step: Callable[[Any], Any], post: Callable[[tuple | None], None]) -> None:
        """step(msg) -> result runs one plan (or returns a callable that completes its result, called
        on this thread right before posting); post((step_id, result or exception)) hands an answer
        to the event loop, post(None) says there will be no more."""
        self._runner, self._step, self._post = runner, step, post
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

    def put(self, msg) -> None:
        self._plans.put(msg)

    def finish(self) -> None:
        """No more plans: stop once the queued ones ran."""
        self._plans.put(_FINISH)

    def close(self) -> None:
        """The stream is gone: stop after the step running now, dropping queued plans."""
        self._closed = True
        self._plans.put(_FINISH)

    def run(self) -> None:
        """On the step thread, until finish() or close()."""
        pending: list[tuple] = []  # the last result, not posted yet

        def flush() -> None:
            if pending:
                step_id, result = pending.pop()
                if callable(result):  # a deferred step (ModelRunner.execute(defer=True)): complete it now
                    try:
                        result = result()
                    except Exception as exc:
                        result = exc
                self._post((step_id, result))

        self._runner.on_compute = flush
        try:
            while True:
                if pending and self._plans.empty():
                    flush()  # nothing queued behind it: no reason to hold it
                msg = self._plans.get()
                if msg is _FINISH or self._closed:
                    break
                try:
                    result = self._step(msg)
                except Exception as exc:  # the stream ends with it
                    flush()
                    self._post((msg.step_id, exc))
                    break
                flush()  # a step without compute (releases only) did not post the one before
                pending.append((msg.step_id, result))
        finally:
            flush()
            self._runner.on_compute = None
            self._post(None)
