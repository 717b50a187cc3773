"""The WorkerLink to a fake worker (tests/doubles/fake_worker.py, anything with
execute(plan) -> StepResult): plans queue in order, each runs when its result is
asked for; and `drive`, the scheduler tests' loop: the StepDriver over it.

`fail_step` makes the worker lose the plan with that step id (WorkerLost), as a
broken stream or a failed step would, to exercise the driver's failure policy.
"""
from __future__ import annotations

import asyncio
from collections import deque

from services.scheduler.driver import DriverHooks, StepDriver
from services.scheduler.worker_link import WorkerLost
from services.step.contract import StepPlan, StepResult


class FakeLink:
    def __init__(self, worker, fail_step: int | None = None) -> None:
        self.worker, self.fail_step = worker, fail_step
        self.sent: deque[StepPlan] = deque()  # not answered yet, oldest first
        self.closed = False

    async def send(self, plan: StepPlan) -> None:
        assert not self.closed, "a plan sent on a closed link"
        self.sent.append(plan)

    async def receive(self, plan: StepPlan, started: float) -> StepResult:
        oldest = self.sent.popleft()
        assert oldest is plan, f"asked for step {plan.step_id}, step {oldest.step_id} is the oldest"
        if plan.step_id == self.fail_step:
            raise WorkerLost(f"worker error: step {plan.step_id} lost")
        return self.worker.execute(plan)

    async def idle(self, wake: asyncio.Event) -> None:
        await wake.wait()

    async def prepare_grammar(self, constraint) -> None:
        """The worker's grammar cache, when the fake worker has one (else nothing to compile)."""
        grammars = getattr(self.worker, "grammars", None)
        if grammars is not None:
            await asyncio.to_thread(grammars.prepare, constraint)

    def close(self) -> None:
        self.closed = True
        self.sent.clear()


def drive(sched, worker, depth: int = 1, on_round=None, max_rounds: int = 5000) -> dict:
    """Run the StepDriver over a FakeLink to `worker` until `sched` is idle, checking its
    invariants every round (on_round(sched) after them); the first error fails the test.
    Returns rid -> [output tokens, finish reason, cached tokens]."""
    results: dict = {}
    rounds = 0

    def deliver(outs):
        for o in outs:
            entry = results.setdefault(o.rid, [[], None, 0])
            entry[0].extend(o.token_ids)
            assert entry[1] is None, f"{o.rid} ended twice"
            if o.finished:
                entry[1], entry[2] = o.finish_reason, o.cached_tokens

    def between_steps(core):  # after each round of the loop
        nonlocal rounds
        rounds += 1
        assert rounds <= max_rounds, "scheduler did not go idle: livelock or deadlock"
        core.check_invariants()
        if on_round:
            on_round(core)

    async def recover(exc, reason):
        raise exc

    hooks = DriverHooks(recover, between_steps=between_steps, deliver=deliver)
    asyncio.run(StepDriver(hooks, sched, FakeLink(worker), depth, busy_wait_s=0).run())
    assert sched.steps_in_flight == 0 and not sched.has_work
    return results
