"""One table of the convergence study from its runs' evaluation curves (bench/convergence.py): the
targets, every arm's steps ratio to them with its interval and verdict, the null row, the controls and
the held-out confirmation. Pure functions of the curves, so the rules are tested on synthetic ones
(tests/bench/test_convergence.py).

Targets. One per fraction f of the run (25/50/100%), the same for every seed and arm: the median, over
the baseline's runs on the main seeds, of each run's metric at f·steps: where a typical baseline run
is at f·steps. Not a seed's own evaluation at f·steps, which that seed's baseline reaches by definition
and an arm can miss by evaluation noise alone; the median rather than the mean, so that one diverged
run cannot move it.

Ratios. An arm's seed s: f·steps (the baseline's steps to the target, by its definition) / the steps
the arm's run on s needs to reach it; > 1: faster. A run that never reaches it is censored: its ratio
lies below f·steps / its last step. Not paired with the baseline's run on s, whose own crossing would
add that seed's noise and, at 100%, censor half of the ratios from the baseline's side. Per target:
the median over seeds and its distribution-free interval (convergence_lib.median_interval, ≥ 90%).
  null      the baseline's runs on the null seeds (s + offset: independent weights, data, noise and
            evaluation draws), which did not set the targets: what "no effect" looks like, the
            targets' own noise included (no verdict of its own: it is what the verdicts must beat)
  heldout   the strongest arm, chosen on the main seeds, run on the null seeds it was not chosen on
            (the winner's curse)
  vs        an arm against each of its controls (arms that differ from it in one knob), paired by seed:
            control steps / arm steps, censored on either side; both runs share the targets, so their
            noise cancels and the verdict needs only the interval to exclude 1
Verdict: "faster" (↑) when the interval lies above 1 and above the null row's median, "slower" (↓)
when it lies below both; otherwise none. A pure-noise arm gets an arrow no more often than the
interval's level allows (tested).
"""
from __future__ import annotations

import math
import statistics

from convergence_lib import Crossing, first_crossing, median_interval, ratio_bounds, value_at

NULL, HELDOUT = "null", "heldout"
LEVEL = 0.9


def targets(baseline_curves: list[dict | None], steps: int, fracs) -> dict[str, float]:
    """{str(f): the median over the baseline runs of each run's value at f·steps}."""
    out = {}
    for f in fracs:
        vals = [value_at(f * steps, c["steps"], c["value"]) for c in baseline_curves if c and c["steps"]]
        vals = [v for v in vals if v == v]
        out[str(f)] = statistics.median(vals) if vals else math.nan
    return out


def verdict(stat: dict, null: dict | None) -> str | None:
    """faster / slower / None: the interval must exclude 1 and the null row's median (where known)."""
    lo, hi = stat["ci"]
    m = (null or {}).get("median")
    if lo is not None and lo > 1 and (m is None or lo > m):
        return "faster"
    if hi is not None and hi < 1 and (m is None or hi < m):
        return "slower"
    return None


def _crossing(c: dict | None, target: float) -> Crossing | None:
    return first_crossing(c["steps"], c["value"], target) if c and c["steps"] and target == target else None


def compare(pairs: list[tuple[dict | None, dict | float | None]], target: float) -> dict:
    """Per seed (arm curve, reference: a curve, or the reference's steps) → the interval of reference
    steps / arm steps over the seeds where both exist."""
    bounds = []
    for mine, ref in pairs:
        a = _crossing(mine, target)
        b = Crossing(float(ref), False) if isinstance(ref, (int, float)) else _crossing(ref, target)
        if a and b:
            bounds.append(ratio_bounds(a, b))
    return {**median_interval(bounds, LEVEL), "per_seed": [list(b) for b in bounds]}


def row(runs: dict[int, dict | None], tg: dict[str, float], steps: int, null: dict | None,
        controls: dict[str, dict[int, dict | None]] | None = None) -> dict:
    """An arm's row from its runs {seed: curve}; `controls` {name: {seed: curve}} (paired by seed)."""
    out, seeds = {}, list(runs)
    for f, target in tg.items():
        t = compare([(runs[s], float(f) * steps) for s in seeds], target)
        t["verdict"] = verdict(t, (null or {}).get(f))
        t["vs"] = {}
        for name, ctrl in (controls or {}).items():
            v = compare([(runs[s], ctrl.get(s)) for s in seeds], target)
            t["vs"][name] = {**v, "verdict": verdict(v, None)}  # paired: the targets' noise cancels
        out[f] = t
    last = max(tg, key=float)
    per_seed = []
    for s, c in runs.items():
        if c and c["steps"]:
            a = _crossing(c, tg[last])
            per_seed.append({"seed": s, "steps_to_target": a.steps if a else None,
                             "censored": a.censored if a else None,
                             "value_at_end": value_at(min(steps, c["steps"][-1]), c["steps"], c["value"])})
    return {"targets": out, "seeds": len(per_seed), "per_seed": per_seed}


def reference_row(runs: dict[int, dict | None], tg: dict[str, float], steps: int) -> dict:
    """The baseline's own row: it sets the targets, so its ratio is 1 by definition."""
    r = row(runs, tg, steps, None)
    for t in r["targets"].values():
        t.update(median=1.0, ci=[1.0, 1.0], ci_bound=[False, False], censored=0, coverage=1.0, verdict=None)
    return r


def analyse_table(curves: dict[str, dict[int, dict | None]], arms: dict, seeds: list[int], null_seeds: list[int],
                  steps: int, fracs, confirm: str | None = None) -> tuple[dict, dict]:
    """Rows {name: row} (baseline, null, every arm, heldout when `confirm` names an arm) and the table's
    targets. `curves[arm][seed]`: the baseline's on the main and the null seeds, the confirmed arm's
    on both; `arms[name].controls` name the arms it is also compared with."""
    base = curves.get("baseline", {})
    tg = targets([base.get(s) for s in seeds], steps, fracs)
    rows = {"baseline": reference_row({s: base.get(s) for s in seeds}, tg, steps),
            NULL: row({h: base.get(h) for h in null_seeds}, tg, steps, None)}
    null = rows[NULL]["targets"]
    for t in null.values():  # the comparator, not a claim: its interval shows how far the targets' own noise
        t["verdict"] = None  # moves a run with no effect (without the median guard it would get an arrow ~10%)
    for name, arm in arms.items():
        if name == "baseline":
            continue
        mine = curves.get(name, {})
        ctrls = {c: curves[c] for c in arm.controls if c in curves}
        rows[name] = row({s: mine.get(s) for s in seeds}, tg, steps, null, ctrls)
    if confirm:
        held = curves.get(confirm, {})
        rows[HELDOUT] = row({h: held.get(h) for h in null_seeds}, tg, steps, null)
    return rows, {"targets": tg}


def strongest(rows: dict, candidates) -> str | None:
    """The candidate arm with the largest determined median ratio at the last target (ties: the higher
    lower end): the one the held-out seeds confirm."""
    best = []
    for name in candidates:
        r = rows.get(name)
        if not r:
            continue
        t = r["targets"][max(r["targets"], key=float)]
        if t["median"] is not None:
            best.append((t["median"], t["ci"][0] or 0.0, name))
    return max(best)[2] if best else None
