"""The one scheduling loop: plan → send → deliver → receive → process, against any WorkerLink.

With `depth` 2 (overlapped scheduling) the next plan is sent while the worker runs
the last one, so the worker finds it queued when it finishes a step; the loop
plans, delivers and processes while the worker computes (services/scheduler/
scheduler.py says how the core plans ahead). With `depth` 1 each plan waits for
the last one's result (lockstep).

Failure policy, the same for every driver: when the worker is lost (WorkerLost)
or the loop fails (a bug: the core's state cannot be trusted), the link is
closed and `hooks.recover` ends every open request and returns a fresh core and
link; driving goes on with those. The worker's KV may be gone, so nothing the
old core cached is trusted.

The scheduler service (services/scheduler/service.py), the in-process Engine
(services/engine/engine.py) and the scheduler's unit tests drive the core with it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

from services.common.outputs import RequestOutput
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_link import WorkerLink, WorkerLost
from services.step.contract import StepPlan

log = logging.getLogger(__name__)


def _nothing(*_args) -> None:
    return None


@dataclass
class DriverHooks:
    """What the driver's owner does at each point of the loop."""
    # (exception, reason) → a fresh (core, link), after ending every open request with `reason`.
    recover: Callable[[Exception, str], Awaitable[tuple[Scheduler, WorkerLink]]]
    between_steps: Callable[[Scheduler], None] = _nothing  # before each schedule(): new work, early stops
    emitted: Callable[[list[RequestOutput], float], None] = _nothing  # outputs of schedule() (aborts), when known
    stepped: Callable[[StepPlan, float, float, list[RequestOutput]], None] = _nothing  # (plan, started, ended, outs)
    deliver: Callable[[list[RequestOutput]], None] = _nothing  # every output, while the worker computes


class StepDriver:
    def __init__(self, hooks: DriverHooks, core: Scheduler, link: WorkerLink, depth: int = 2,
                 wake: asyncio.Event | None = None, busy_wait_s: float = 0.002) -> None:
        """depth: plans in flight at most (1 lockstep, 2 overlapped). wake: set when new work
        arrives; None returns from run() once nothing is left to do (tests)."""
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth}")
        self.hooks, self.core, self.link, self.depth = hooks, core, link, depth
        self.wake, self.busy_wait_s = wake, busy_wait_s
        self._compiles: set[asyncio.Task] = set()  # grammar compiles in flight (services/scheduler/grammar_queue.py)

    async def run(self) -> None:
        """Drive until cancelled (or idle, without `wake`), recovering from failures."""
        while True:
            try:
                await self._drive(self.core, self.link)
                return
            except asyncio.CancelledError:
                raise
            except WorkerLost as exc:
                failure, reason = exc, str(exc)
                log.error("worker lost", extra={"error": reason})
            except Exception as exc:
                failure, reason = exc, f"scheduler error: {exc!r}"
                log.exception("scheduler loop failed")
            self.link.close()
            self.core, self.link = await self.hooks.recover(failure, reason)

    async def _drive(self, core: Scheduler, link: WorkerLink) -> None:
        hooks = self.hooks
        sent: deque[tuple[StepPlan, float]] = deque()  # (plan, when sent), oldest first
        outputs: list[RequestOutput] = []
        last_read = time.monotonic()
        while True:
            hooks.between_steps(core)
            for constraint in core.take_grammar_jobs():
                task = asyncio.create_task(self._prepare_grammar(core, link, constraint))
                self._compiles.add(task)
                task.add_done_callback(self._compiles.discard)
            plan = core.schedule() if len(sent) < self.depth else None
            taken = core.take_outputs()
            hooks.emitted(taken, time.monotonic())
            outputs += taken
            if plan is not None:
                await link.send(plan)
                sent.append((plan, time.monotonic()))
            hooks.deliver(outputs)  # while the worker computes
            outputs = []
            if plan is not None and len(sent) < self.depth:
                continue  # plan the next one while this one runs
            if not sent:
                if not await self._wait_for_work(core, link):
                    return
                continue
            oldest, written = sent[0]
            started = max(written, last_read)  # it started when sent or when the one before ended
            result = await link.receive(oldest, started)
            last_read = time.monotonic()
            sent.popleft()
            outputs = core.process(result)
            hooks.stepped(oldest, started, last_read, outputs)

    async def _prepare_grammar(self, core: Scheduler, link: WorkerLink, constraint) -> None:
        """Compile at the worker while the loop goes on; then release the requests waiting for it."""
        error = None
        try:
            await link.prepare_grammar(constraint)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request fails; the loop does not
            error = f"grammar compilation failed: {exc}"
            log.error("grammar compilation failed", extra={"key": constraint.key, "error": str(exc)})
        if self.core is core:
            core.grammar_prepared(constraint.key, error)
            if self.wake is not None:
                self.wake.set()

    async def _wait_for_work(self, core: Scheduler, link: WorkerLink) -> bool:
        """Nothing in flight: False when driving should end (idle, no `wake`)."""
        if core.has_work:
            await asyncio.sleep(self.busy_wait_s)  # e.g. a prefill waits for a shared prefix
        elif self.wake is None:
            return False
        else:
            await link.idle(self.wake)
            self.wake.clear()
        return True
