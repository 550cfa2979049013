"""95% intervals for accuracy figures: Wilson for pass/fail scores, Student t for mean scores.

Scores are on the 0-100 scale of `s4r.bench.scoring`. A cell whose every score is 0 or 100 is a
proportion (Wilson score interval, sensible even at 0/n or n/n); anything else (partial credit of the
multi-answer tasks) is a mean with a t interval. A mean over tasks is a stratified mean: the tasks'
variances are combined, each task weighted equally.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """A mean (0-100), its 95% interval and the number of samples behind it."""

    mean: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return {"score": round(self.mean, 2), "ci_low": round(self.low, 2), "ci_high": round(self.high, 2),
                "samples": self.n}


def t_quantile_975(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (Cornish-Fisher expansion,
    within 0.3% of the exact value for df >= 3; exact table below that)."""
    if df < 1:
        return math.inf
    exact = {1: 12.706, 2: 4.303}
    if df in exact:
        return exact[df]
    z = Z95
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def wilson(successes: int, n: int) -> Interval:
    """Wilson score interval of a proportion, scaled to 0-100."""
    if n < 1:
        return Interval(math.nan, math.nan, math.nan, 0)
    p = successes / n
    z2 = Z95**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return Interval(100 * p, 100 * max(0.0, centre - half), 100 * min(1.0, centre + half), n)


def _variance(values: Sequence[float]) -> float:
    m = math.fsum(values) / len(values)
    return math.fsum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else math.nan


def difference_interval(values: Sequence[float]) -> Interval:
    """Student t interval of a mean, unclipped: for paired differences, which may be negative (a single
    value has no interval: NaN)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile_975(n - 1) * math.sqrt(_variance(values) / n)
    return Interval(mean, mean - half, mean + half, n)


def mean_interval(values: Sequence[float]) -> Interval:
    """Student t interval of a mean score, clipped to 0-100 (a single value has no interval: NaN)."""
    ci = difference_interval(values)
    if ci.n < 2:
        return ci
    return Interval(ci.mean, max(0.0, ci.low), min(100.0, ci.high), ci.n)


def is_pass_fail(values: Sequence[float]) -> bool:
    """Whether every score is 0 or 100 (a proportion)."""
    return all(v in (0.0, 100.0) for v in values)


def score_interval(values: Sequence[float]) -> Interval:
    """Wilson for pass/fail scores, t for partial-credit ones."""
    if values and is_pass_fail(values):
        return wilson(sum(1 for v in values if v == 100.0), len(values))
    return mean_interval(values)


def stratified_interval(groups: Sequence[Sequence[float]]) -> Interval:
    """The equally weighted mean of the groups' means (tasks), with a normal 95% interval from the
    groups' sample variances (a group of one sample contributes no variance: the interval is NaN)."""
    groups = [g for g in groups if g]
    if not groups:
        return Interval(math.nan, math.nan, math.nan, 0)
    if len(groups) == 1:
        return score_interval(groups[0])  # one task: the cell's own interval
    k = len(groups)
    mean = math.fsum(math.fsum(g) / len(g) for g in groups) / k
    n = sum(len(g) for g in groups)
    if any(len(g) < 2 for g in groups):
        return Interval(mean, math.nan, math.nan, n)
    # pass/fail groups: the binomial variance p(1-p) (with a Wilson-style +2/+4 guard against 0/n)
    var = 0.0
    for g in groups:
        if is_pass_fail(g):
            p = (sum(1 for v in g if v == 100.0) + 2) / (len(g) + 4)
            var += 100.0**2 * p * (1 - p) / (len(g) + 4)
        else:
            var += _variance(g) / len(g)
    half = Z95 * math.sqrt(var) / k
    return Interval(mean, max(0.0, mean - half), min(100.0, mean + half), n)
