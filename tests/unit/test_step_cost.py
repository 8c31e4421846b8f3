from __future__ import annotations

import pytest

from engine.step_cost import StepCostFit


def test_recovers_overhead_and_per_token_cost() -> None:
    fit = StepCostFit()
    for n in (16, 64, 256, 512, 1024, 100, 700):
        fit.observe(n, 0.004 + 0.0005 * n)
    overhead, per_token = fit.coefficients()
    assert overhead == pytest.approx(0.004, rel=1e-6)
    assert per_token == pytest.approx(0.0005, rel=1e-6)


def test_one_prompt_length_gives_a_rate_without_intercept() -> None:
    fit = StepCostFit()
    fit.observe(100, 0.2)
    fit.observe(100, 0.2)
    assert fit.coefficients() == pytest.approx((0.0, 0.002))


def test_nothing_observed_is_zero() -> None:
    assert StepCostFit().coefficients() == (0.0, 0.0)


def test_recent_steps_weigh_more() -> None:
    fit = StepCostFit(decay=0.5)
    for _ in range(10):
        fit.observe(100, 0.1)
    for _ in range(10):
        fit.observe(200, 0.8)  # the worker got slower
    _, per_token = fit.coefficients()
    assert per_token > 0.003
