"""The speculation policy's prices (services/scheduler/step_costs.py): a decode step's measured
seconds by its tokens, interpolated between measured sizes, the prior before any, and the
drafter's seconds per drafted token net of its per-step base."""
from __future__ import annotations

import pytest

from services.scheduler.step_costs import StepCosts


def test_the_prior_before_any_step_is_timed():
    costs = StepCosts(0.2)
    assert costs.step(1) == 1.0 and costs.step(4) == pytest.approx(1.6)
    assert costs.draft(3) == 0.0


def test_measured_steps_interpolate_and_extrapolate_by_their_slope():
    costs = StepCosts(0.2)
    costs.observe_step(1, 0.010, 0.0, 0)
    costs.observe_step(4, 0.019, 0.0, 0)
    assert costs.step(1) == pytest.approx(0.010) and costs.step(4) == pytest.approx(0.019)
    assert costs.step(2) == pytest.approx(0.013)  # a third of the way from 1 to 4
    assert costs.step(6) == pytest.approx(0.025)  # 3 ms per token beyond 4, the measured slope
    only_one = StepCosts(0.2)
    only_one.observe_step(1, 0.010, 0.0, 0)
    assert only_one.step(3) == pytest.approx(0.014)  # the prior's shape, scaled to the one measured size
    only_big = StepCosts(0.5)
    only_big.observe_step(5, 0.030, 0.0, 0)
    assert only_big.step(1) == pytest.approx(0.010)  # 30 ms / (1 + 0.5 * 4)
    verifies = StepCosts(0.1)  # speculating from the first decode: no one-token step was run
    verifies.observe_step(2, 0.022, 0.0, 0)
    verifies.observe_step(4, 0.046, 0.0, 0)
    assert verifies.step(1) == pytest.approx(0.010)  # the verify sizes' slope, not the prior's


def test_the_average_follows_new_measurements_and_ignores_untimed_steps():
    costs = StepCosts(0.2)
    costs.observe_step(2, 0.010, 0.0, 0)
    for _ in range(60):
        costs.observe_step(2, 0.020, 0.0, 0)
    assert costs.step(2) == pytest.approx(0.020, rel=0.01)
    costs.observe_step(3, 0.0, 0.0, 0)  # a worker that reports no time (the model-free double)
    assert 3 not in costs.seconds


def test_drafting_is_priced_per_token_beyond_its_per_step_base():
    costs = StepCosts(0.2)
    costs.observe_step(1, 0.011, 0.001, 0)  # no draft asked: the drafter only extended (1 ms)
    costs.observe_step(2, 0.019, 0.007, 3)  # 3 tokens drafted in 7 ms: 2 ms each beyond the base
    assert costs.step(1) == pytest.approx(0.010) and costs.step(2) == pytest.approx(0.012)
    assert costs.draft(3) == pytest.approx(0.006) and costs.draft(0) == 0.0
