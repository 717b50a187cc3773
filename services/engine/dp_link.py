"""The WorkerLink of one data-parallel-attention rank's scheduler in the Engine: its plans join
the group's rounds (services/worker/group/dp_rounds.py), run on the Engine's one step thread."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from services.scheduler.worker_link import WorkerLost
from services.step.contract import StepPlan, StepResult
from services.worker.group.dp_rounds import DpRounds

log = logging.getLogger(__name__)


class DpRankLink:
    def __init__(self, rounds: DpRounds, rank: int, runner, executor: ThreadPoolExecutor) -> None:
        self._rounds, self._rank, self._runner, self._executor = rounds, rank, runner, executor
        self._queued: deque = deque()  # oldest first: the plans' futures

    async def send(self, plan: StepPlan) -> None:
        ticket = self._rounds.enqueue(self._rank, plan)
        self._queued.append(asyncio.get_running_loop().run_in_executor(self._executor, self._rounds.result, ticket))

    async def receive(self, plan: StepPlan, started: float) -> StepResult:
        queued = self._queued.popleft()
        try:
            return await queued
        except Exception as exc:
            log.exception("data-parallel rank %d: step %d failed", self._rank, plan.step_id)
            raise WorkerLost(f"worker error: {exc}") from exc

    async def idle(self, wake: asyncio.Event) -> None:
        await wake.wait()

    async def prepare_grammar(self, constraint) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._runner.grammars.prepare, constraint)

    def close(self) -> None:
        for queued in self._queued:
            if not queued.cancel():
                queued.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queued.clear()
