"""The WorkerLink to a ModelRunner in this process.

Plans run in order on the Engine's step thread (an executor of one thread, the
thread that built the runner) as they are sent. Overlapped, the driver plans the
next step while this one computes (torch's kernels release the GIL), as the
scheduler service does over gRPC; in lockstep it waits for each result first.
The runner fills a decode's LAST_SAMPLED input with the token it sampled for the
request last (services/worker/model_runner.py). A step
that raises loses the worker: WorkerLost, and the driver's failure policy.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from services.scheduler.worker_link import WorkerLost
from services.step.contract import StepPlan, StepResult
from services.worker.group.dp_rounds import DpRounds

log = logging.getLogger(__name__)


class RunnerLink:
    def __init__(self, runner, executor: ThreadPoolExecutor,
                 step: Callable[[StepPlan], Callable[[], StepResult]] | None = None) -> None:
        """runner: a ModelRunner (its execute(plan) -> StepResult); executor: its step thread.
        step(plan), called as the plan is sent: what the step thread runs for it; default
        runner.execute(plan). A data-parallel rank's scheduler joins the group's rounds instead
        (dp_step)."""
        self._runner, self._executor = runner, executor
        self._step = step or (lambda plan: functools.partial(runner.execute, plan))
        self._queued: deque = deque()  # oldest first: the plans' futures

    async def send(self, plan: StepPlan) -> None:
        loop = asyncio.get_running_loop()
        self._queued.append(loop.run_in_executor(self._executor, self._step(plan)))

    async def receive(self, plan: StepPlan, started: float) -> StepResult:
        queued = self._queued.popleft()
        try:
            return await queued
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            raise WorkerLost(f"worker error: {exc}") from exc

    async def idle(self, wake: asyncio.Event) -> None:
        await wake.wait()

    async def prepare_grammar(self, constraint) -> None:
        """On the loop's default executor: the step thread goes on stepping meanwhile."""
        await asyncio.get_running_loop().run_in_executor(None, self._runner.grammars.prepare, constraint)

    def close(self) -> None:
        """Drop the plans not started yet (one already running ends on its own)."""
        for queued in self._queued:
            if not queued.cancel():  # running or done
                queued.add_done_callback(_forget)
        self._queued.clear()


def _forget(future: asyncio.Future) -> None:
    """A step nobody waits for any more: its failure, if any, is not news."""
    if not future.cancelled():
        future.exception()


def dp_step(rounds: DpRounds, rank: int) -> Callable[[StepPlan], Callable[[], StepResult]]:
    """A RunnerLink step for data-parallel rank `rank`'s scheduler: the plan queues in the rank's
    inbox as it is sent, and the step thread runs rounds until it has run (dp_rounds.py)."""
    return lambda plan: functools.partial(rounds.result, rounds.enqueue(rank, plan))
