"""95% intervals of the accuracy figures, the held-out book and answer budgets of the bench tasks."""

from __future__ import annotations

import math

import pytest

from s4r.bench.intervals import (
    difference_interval,
    mean_interval,
    score_interval,
    stratified_interval,
    t_quantile_975,
    wilson,
)
from s4r.bench.tasks import HELDOUT_BOOK, TASK_SETS, TUNING_BOOK, answer_budget, make_sample


def test_wilson_matches_known_values():
    # reference values of the Wilson score interval (z = 1.96)
    ci = wilson(10, 20)
    assert (round(ci.low, 1), round(ci.high, 1)) == (29.9, 70.1)
    ci = wilson(0, 20)
    assert ci.low == 0.0 and round(ci.high, 1) == 16.1
    ci = wilson(20, 20)
    assert round(ci.low, 1) == 83.9 and ci.high == 100.0
    assert wilson(0, 0).n == 0 and math.isnan(wilson(0, 0).mean)


@pytest.mark.parametrize(("df", "exact"), [(2, 4.303), (5, 2.571), (10, 2.228), (19, 2.093), (30, 2.042)])
def test_t_quantiles(df, exact):
    assert t_quantile_975(df) == pytest.approx(exact, rel=3e-3)


def test_mean_interval_is_a_t_interval_clipped_to_the_scale():
    ci = mean_interval([25.0, 50.0, 75.0, 100.0])
    half = t_quantile_975(3) * math.sqrt(((37.5**2 + 12.5**2) * 2 / 3) / 4)
    assert ci.mean == 62.5 and ci.low == pytest.approx(62.5 - half) and ci.high == 100.0
    assert math.isnan(mean_interval([40.0]).low)


def test_difference_interval_is_the_same_t_interval_unclipped():
    # paired differences (points or nats) go below 0 and above 100; only scores are clipped
    ci = difference_interval([-75.0, -50.0, -25.0, 0.0])
    half = t_quantile_975(3) * math.sqrt(((37.5**2 + 12.5**2) * 2 / 3) / 4)
    assert ci.mean == -37.5
    assert ci.low == pytest.approx(-37.5 - half) and ci.high == pytest.approx(-37.5 + half)
    assert difference_interval([150.0, 152.0, 154.0, 156.0]).low > 100.0
    assert math.isnan(difference_interval([-3.0]).high) and difference_interval([]).n == 0


def test_pass_fail_scores_get_wilson_partial_ones_t():
    assert score_interval([100.0] * 7 + [0.0] * 13) == wilson(7, 20)
    assert score_interval([25.0, 50.0, 100.0]) == mean_interval([25.0, 50.0, 100.0])


def test_stratified_mean_weights_tasks_equally_and_narrows_with_samples():
    small = stratified_interval([[100.0] * 5 + [0.0] * 5, [100.0] * 10])
    large = stratified_interval([[100.0] * 50 + [0.0] * 50, [100.0] * 100])
    assert small.mean == large.mean == 75.0 and small.n == 20 and large.n == 200
    assert large.high - large.low < small.high - small.low
    # an unequal sample count does not weight the bigger task more
    assert stratified_interval([[0.0] * 2, [100.0] * 20]).mean == 50.0


def _count(text: str) -> int:
    return len(text.split())


def test_the_held_out_book_changes_the_haystack_and_the_needles():
    tune = make_sample("niah_single_book", 800, 0, _count, 0.5)
    assert make_sample("niah_single_book", 800, 0, _count, 0.5, book=TUNING_BOOK) == tune
    held = make_sample("niah_single_book", 800, 0, _count, 0.5, book=HELDOUT_BOOK)
    assert held.context != tune.context and held.answers != tune.answers
    assert "ROMEO" in held.context or "Romeo" in held.context
    assert set(TASK_SETS["needles"]) == {"niah_single_book", "niah_multikey", "niah_multivalue"}


def test_answer_budget_fits_the_reference():
    sample = make_sample("niah_multivalue", 800, 0, _count, book=TUNING_BOOK)
    assert answer_budget(sample, _count, 32) == len(sample.answers) + 4
    assert answer_budget(sample, _count, 3) == 3
