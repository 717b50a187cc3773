"""The worker's step thread (services/worker/step_loop.py): answers in plan order, a result
held back only while the next plan is already queued, until that plan's compute begins."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from services.worker.step_loop import StepLoop


@dataclass
class Plan:
    step_id: int
    compute: bool = True  # False: a plan with nothing to run (releases only)
    fail: bool = False


class Runner:
    on_compute = None


def start(plans: list[Plan], finish: bool = True):
    """A StepLoop fed `plans` before it starts (so each finds the next one queued)."""
    runner, events = Runner(), []

    def step(plan: Plan) -> str:
        events.append(f"prepare {plan.step_id}")
        if plan.fail:
            raise ValueError(f"step {plan.step_id} broke")
        if plan.compute:
            runner.on_compute()
            events.append(f"compute {plan.step_id}")
        return f"result {plan.step_id}"

    loop = StepLoop(runner, step, lambda item: events.append(("post", item)))
    for p in plans:
        loop.put(p)
    if finish:
        loop.finish()
    thread = threading.Thread(target=loop.run)
    thread.start()
    return loop, thread, runner, events


def test_results_leave_in_order_each_when_the_next_step_starts_computing():
    _, thread, runner, events = start([Plan(1), Plan(2, compute=False), Plan(3)])
    thread.join(5)
    assert events == [
        "prepare 1", "compute 1",
        "prepare 2",  # no compute: result 1 leaves after it, result 2 is held for step 3
        ("post", (1, "result 1")),
        "prepare 3", ("post", (2, "result 2")), "compute 3",
        ("post", (3, "result 3")),  # nothing queued behind it
        ("post", None)]
    assert runner.on_compute is None


def test_a_result_is_not_held_when_no_plan_is_queued():
    loop, thread, _, events = start([Plan(1)], finish=False)
    for _ in range(500):  # the loop posts result 1 by itself, then waits for a plan
        if ("post", (1, "result 1")) in events:
            break
        threading.Event().wait(0.01)
    assert events == ["prepare 1", "compute 1", ("post", (1, "result 1"))]
    loop.put(Plan(2))
    loop.finish()
    thread.join(5)
    assert events[-2:] == [("post", (2, "result 2")), ("post", None)]


def test_a_failed_step_posts_the_one_before_then_its_error_and_stops():
    _, thread, _, events = start([Plan(1), Plan(2, fail=True), Plan(3)])
    thread.join(5)
    assert events[:3] == ["prepare 1", "compute 1", "prepare 2"]
    assert events[3] == ("post", (1, "result 1"))
    step_id, exc = events[4][1]
    assert step_id == 2 and isinstance(exc, ValueError)
    assert events[5:] == [("post", None)]  # plan 3 never ran


def test_close_drops_queued_plans():
    loop, thread, _, events = start([], finish=False)
    loop.close()
    loop.put(Plan(1))
    thread.join(5)
    assert events == [("post", None)]
