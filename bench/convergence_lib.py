"""Steps (and seconds) to a target metric from evaluation curves, and intervals over seeds: the
arithmetic of the convergence study (bench/convergence.py), kept apart so that it can be tested on
synthetic curves.

A run's curve is its evaluations (step, metric; lower is better), read as piecewise linear between
evaluations. The first crossing of the target is where the curve first reaches it: between two
evaluations at the linearly interpolated step, exactly at an evaluation that equals it (a tie counts
as reached). A run that never reaches it is censored: its steps-to-target is only known to exceed
its last step.

A seed's ratio (reference steps / arm steps, > 1: the arm is faster) is therefore known within bounds
(`ratio_bounds`): exact where both reached the target, below a bound where the arm did not, above one
where the reference did not, anything where neither did. `median_interval` gives the median over seeds
and a distribution-free interval for it that holds for any values inside the bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Crossing:
    steps: float          # interpolated step of the first crossing, or the last step if censored
    censored: bool        # never reached: steps is a lower bound

    def ratio_to(self, base: Crossing) -> tuple[float, str]:
        """base.steps / self.steps (the speed-up over the baseline) and how it is bounded:
        "=" exact, ">" a lower bound (this run did not reach it), "<" an upper bound (the baseline did
        not), "?" both censored."""
        if self.censored and base.censored:
            return math.nan, "?"
        if self.steps <= 0:  # reached at the first evaluation: as fast as can be told (a tie if both were)
            return (1.0 if base.steps <= 0 else math.inf), "="
        r = base.steps / self.steps
        return r, ("<" if self.censored else (">" if base.censored else "="))


def first_crossing(steps: list[float], values: list[float], target: float) -> Crossing:
    """Where a curve (values at increasing steps, lower is better) first reaches `target`."""
    if len(steps) != len(values) or not steps:
        raise ValueError("a curve needs as many values as steps, and at least one")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError("the steps of a curve must increase")
    prev_s, prev_v = None, None
    for s, v in zip(steps, values):
        if v == v and v <= target:  # NaN evaluations never count as reached
            if prev_s is None or prev_v != prev_v or prev_v <= target:
                return Crossing(float(s), False)
            frac = (prev_v - target) / (prev_v - v)  # linear interpolation between the two evaluations
            return Crossing(prev_s + frac * (s - prev_s), False)
        prev_s, prev_v = s, v
    return Crossing(float(steps[-1]), True)


def ratio_bounds(arm: Crossing, base: Crossing) -> tuple[float, float]:
    """(lo, hi): every value of base steps / arm steps that the censoring allows. An arm that never got
    there: below base / its last step (lo 0; hi just below the bound: its steps exceed its last one); a
    baseline that never did: above its last step / arm (hi inf); neither: (0, inf)."""
    r, kind = arm.ratio_to(base)
    return {"=": (r, r), "<": (0.0, math.nextafter(r, 0.0)), ">": (math.nextafter(r, math.inf), math.inf),
            "?": (0.0, math.inf)}[kind]


def seconds_at(step: float, steps: list[float], seconds: list[float]) -> float:
    """Wall-clock seconds of training at a (fractional) step, interpolating the cumulative clock."""
    if step <= steps[0]:
        return seconds[0] * step / steps[0] if steps[0] else 0.0
    for (s0, t0), (s1, t1) in zip(zip(steps, seconds), zip(steps[1:], seconds[1:])):
        if step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return seconds[-1] * step / steps[-1]


def value_at(step: float, steps: list[float], values: list[float]) -> float:
    """The curve at a step (linear between evaluations, NaN outside them)."""
    for (s0, v0), (s1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:])):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return values[-1] if steps and step == steps[-1] else math.nan


@cache
def order_statistic_rank(n: int, level: float = 0.9) -> int:
    """k of the distribution-free interval [x(k), x(n+1−k)] for a median (Conover, Practical
    Nonparametric Statistics, 3rd ed., §3.2): the largest k with P(Binomial(n, ½) ≤ k − 1) ≤ (1 − level)/2,
    so that the interval misses the median with probability ≤ 1 − level whatever the distribution.
    0 when n is too small for the level (fewer than 5 seeds at 90%)."""
    from scipy.stats import binom

    k = 0
    while k < n and binom.cdf(k, n, 0.5) <= (1 - level) / 2:
        k += 1
    return k


def coverage(n: int, k: int) -> float:
    """The probability that [x(k), x(n+1−k)] holds the median of a continuous distribution."""
    from scipy.stats import binom

    return 1.0 - 2 * float(binom.cdf(k - 1, n, 0.5)) if k else 0.0


def median_interval(bounds: list[tuple[float, float]], level: float = 0.9) -> dict:
    """Median over seeds of a ratio known per seed within (lo, hi), and its interval: the k-th smallest
    lower bound to the k-th largest upper bound (k: `order_statistic_rank`). Order statistics only grow
    with the values, so this interval contains the one that the true ratios would give: it covers their
    median with probability ≥ `coverage(n, k)` ≥ level. With 10 seeds it runs from the 2nd smallest to
    the 2nd largest seed (97.9%), with 5 from the smallest to the largest (93.8%), so one seed of ten may
    disagree with an interval that excludes 1.

    Returns {"median", "ci": [lo, hi], "ci_bound": [lo, hi], "censored", "faster", "slower", "n",
    "coverage"}: "ci_bound" flags an end that a censored seed's bound gives (the end lies beyond it); a median
    that the censoring leaves open, an end that no bound limits (0, inf) and an interval the number of seeds
    cannot give at this level are None. "faster"/"slower": seeds whose ratio is surely above/below 1."""
    n = len(bounds)
    if n == 0:
        return {"median": None, "ci": [None, None], "ci_bound": [False, False], "censored": 0, "faster": 0,
                "slower": 0, "n": 0, "coverage": 0.0}
    cens = [a != b for a, b in bounds]
    lo = sorted((b[0], c) for b, c in zip(bounds, cens))  # (value, from a censored seed)
    hi = sorted((b[1], c) for b, c in zip(bounds, cens))
    k = order_statistic_rank(n, level)
    fin = lambda v: float(v) if 0 < v < math.inf else None
    mid = [(n - 1) // 2, n // 2]
    med_lo = sum(lo[i][0] for i in mid) / 2
    med_hi = sum(hi[i][0] for i in mid) / 2
    return {"median": med_lo if med_lo == med_hi and med_lo > 0 else None,  # inf: reached at the first evaluation
            "ci": [fin(lo[k - 1][0]), fin(hi[n - k][0])] if k else [None, None],
            "ci_bound": [bool(k) and lo[k - 1][1], bool(k) and hi[n - k][1]],
            "censored": sum(cens), "faster": sum(b[0] > 1 for b in bounds), "slower": sum(b[1] < 1 for b in bounds),
            "n": n, "coverage": coverage(n, k)}
