from __future__ import annotations

import time

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


def steady(fit: StepCostFit, steps: int = 10) -> None:
    for i in range(steps):  # prompts of 1,000 and 1,001 tokens: 80 ms
        fit.observe(1000 + i % 2, 0.08)


def test_one_step_spanning_a_pause_raises_the_fit_by_a_bounded_share() -> None:
    """A prefill worker paused 3 s mid-step: the old fit predicted 87 s for the next prompt
    (a slope from near-equal sizes, then that step in full), and admission refused every
    request on that idle worker for good."""
    fit = StepCostFit()
    steady(fit)
    fit.observe(1001, 3.0)
    assert 0.08 < fit.predict(1000) < 0.08 * 1.5


def test_a_worker_that_got_slower_for_real_is_learned_in_a_few_dozen_steps() -> None:
    fit = StepCostFit()
    steady(fit, 20)
    steps = 0
    while fit.predict(1000) < 0.9 * 0.8:
        fit.observe(1000, 0.8)  # ten times slower from now on
        steps += 1
    assert steps <= 40


def test_a_size_beyond_those_seen_is_taken_whole() -> None:
    fit = StepCostFit()
    steady(fit)
    fit.observe(8000, 2.0)  # far more than 4x the 640 ms a rate through 80 ms predicts
    assert fit.predict(8000) > 1.0


def test_near_equal_sizes_fit_a_rate_through_the_origin() -> None:
    fit = StepCostFit()
    for size, seconds in [(1000, 0.080), (1001, 0.090)] * 3:
        fit.observe(size, seconds)
    overhead, per_token = fit.coefficients()
    assert overhead == 0.0
    assert per_token == pytest.approx(0.085 / 1000.5, rel=0.01)


def test_a_line_crossing_zero_time_at_a_positive_size_fits_through_the_origin() -> None:
    fit = StepCostFit()
    for size, seconds in [(100, 0.01), (1000, 0.2)] * 3:  # 0.21 ms a token, overhead < 0
        fit.observe(size, seconds)
    overhead, per_token = fit.coefficients()
    assert overhead == 0.0
    assert per_token == pytest.approx(0.21 / 1100, rel=0.01)


def test_a_step_far_faster_than_predicted_starts_the_fit_over() -> None:
    """The first seconds of a host whose every process warmed up at once: prompts at 1 ms
    a token; then a warm step at 0.06 ms a token is what the worker does from now on."""
    fit = StepCostFit()
    for size in (400, 800, 1200, 1600):
        fit.observe(size, 0.001 * size)
    fit.observe(1000, 0.06)
    assert fit.predict(1000) == pytest.approx(0.06)



def test_the_fit_tells_its_age() -> None:
    fit = StepCostFit()
    assert fit.age_s() == 0.0  # nothing to be old
    fit.observe(100, 0.01)
    fit.observed_at_s = time.monotonic() - 7.0
    assert fit.age_s() == pytest.approx(7.0, abs=0.5)
