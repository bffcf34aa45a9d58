"""Steps (and seconds) to a target metric from evaluation curves, and paired intervals over seeds:
the arithmetic of the convergence study (bench/convergence.py), kept apart so that it can be tested
on synthetic curves.

A run's curve is its evaluations (step, metric; lower is better), read as piecewise linear between
evaluations. The first crossing of the target is where the curve first reaches it: between two
evaluations at the linearly interpolated step, exactly at an evaluation that equals it (a tie counts
as reached). A run that never reaches it is censored: its steps-to-target is only known to exceed
its last step, so its speed-up ratio is only known to lie below a bound.

Intervals (`paired_median_ci`): per seed the ratio baseline steps / arm steps (the same seed's
baseline: paired); the median over seeds and a percentile bootstrap over seeds. A censored seed is
ranked below every reached ratio (conservative: its ratio lies below its bound baseline steps /
horizon, and a reached ratio lies above its own, about equal, bound), never counted as its bound:
where the median or an interval end falls on censored seeds it is reported as None ("censored"), so
the interval stays honest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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
        if self.steps <= 0:
            return math.inf, "="
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


def paired_median_ci(ratios: list[tuple[float, bool]], level: float = 0.9, n_boot: int = 20000,
                     seed: int = 0) -> dict:
    """Median and percentile-bootstrap interval of per-seed ratios `(value, censored)`; censored seeds
    rank lowest. Returns {"median", "ci": [lo, hi], "censored", "n"}; a statistic that falls on a
    censored seed is None ("below the censoring bound")."""
    import numpy as np

    n = len(ratios)
    if n == 0:
        return {"median": None, "ci": [None, None], "censored": 0, "n": 0}
    vals = np.array([-np.inf if c or not (v == v) else v for v, c in ratios], dtype=np.float64)

    def med(x):  # the lower median on ties of parity: a conservative order statistic
        x = np.sort(x, axis=-1)
        k = x.shape[-1]
        lo, hi = x[..., (k - 1) // 2], x[..., k // 2]
        return np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, -np.inf)

    rng = np.random.default_rng(seed)
    boot = med(vals[rng.integers(0, n, size=(n_boot, n))])
    q = np.quantile(boot, [(1 - level) / 2, 1 - (1 - level) / 2], method="inverted_cdf")
    fin = lambda v: float(v) if np.isfinite(v) else None
    return {"median": fin(med(vals)), "ci": [fin(q[0]), fin(q[1])], "censored": int(sum(c for _, c in ratios)),
            "n": n}
