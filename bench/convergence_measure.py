"""What the convergence study measures besides its curves (bench/convergence.py): each table's step
times, all of its arms in one measurement, and the metric's own noise at a fixed network.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from convergence_arms import Arm
from convergence_design import overrides


def step_costs(domain: str, batch: int, arms: dict[str, Arm], steps: int, evals: int, timed: int = 60) -> dict:
    """Seconds per training step of every arm of a table, side by side in this process: the trainer's own
    step with the run's overrides, one thread, interleaved rounds of 15 steps (bench/throughput.py), so
    seconds compare the arms and not what ran beside each run. One measurement per table: its seconds
    column and its ms per step both come from it."""
    from throughput import interleaved, trainer

    with tempfile.TemporaryDirectory() as d:
        trs = {a: trainer([o for o in overrides(domain, arm, a, batch, 0, steps, evals, root=Path(d))
                           if not o.startswith(("run_dir=", "eval."))] + ["eval.num_samples=0", "eval.every=0"],
                          Path(d)) for a, arm in arms.items()}
        try:
            cost = interleaved(trs, timed, warmup=6, round_steps=15)
        finally:
            for tr in trs.values():
                tr.close()
    return cost


def run_costs(runs: dict[str, list[Path]]) -> dict:
    """Seconds per training step of every arm: the median over its runs of the median of the run's own
    logged step times (look-aheads included). Cheaper than step_costs but noisier: a run's step time
    depends on what ran beside it (--no-timing)."""
    from fasttrain.logger import read_jsonl

    cost = {}
    for arm, paths in runs.items():
        per_run = []
        for p in paths:
            m = p / "metrics.jsonl"
            times = [r["sec_per_step"] for r in read_jsonl(m) if r.get("sec_per_step")] if m.is_file() else []
            if times:
                per_run.append(statistics.median(times))
        if per_run:
            cost[arm] = statistics.median(per_run)
    return cost


def metric_noise(run: Path, eval_n: int, evals: int = 8, seed: int = 10_000) -> dict:
    """The metric of one fixed network (a finished run's final EMA weights) evaluated `evals` times with
    other sampling seeds: its mean and standard deviation are the evaluation's own noise at eval_n
    samples, which no training difference causes. For 2-D points also the estimator's floor: two
    independent samples of the true density, eval_n points each."""
    from fasttrain.bundle import ModelBundle
    from fasttrain.generation.evaluate import EvalSettings, reference_for, run_evaluation

    b = ModelBundle.load(run, device="cpu")
    key = "fid" if b.spec.image_size else "sw2"
    ref = reference_for(b.cfg, b.spec)
    base = EvalSettings.from_config(b.cfg)
    vals = []
    for k in range(evals):
        s = EvalSettings(num_samples=eval_n, steps=base.steps, solver=base.solver, extractor=base.extractor,
                         bpd=False, seed=seed + k)
        vals.append(run_evaluation(b, s, ref)[key])
    out = {"metric": key, "eval_n": eval_n, "evals": evals, "mean": statistics.mean(vals),
           "sd": statistics.stdev(vals) if evals > 1 else None, "values": vals, "network": str(run)}
    if key == "sw2":
        from fasttrain.data import toy
        from fasttrain.generation.evaluate import sliced_w2

        name = b.cfg.data.name
        floor = [sliced_w2(toy(name, n=eval_n, seed=seed + 2 * k), toy(name, n=eval_n, seed=seed + 2 * k + 1),
                           seed=k) for k in range(evals)]
        out["floor_mean"], out["floor_sd"] = statistics.mean(floor), statistics.stdev(floor) if evals > 1 else None
    return out


def crossing_shift(noise: dict, baseline_curves: list[dict], steps: int) -> dict:
    """How far the metric's noise moves a crossing near the end of the run: its sd over the baseline's
    median improvement per step in the last evaluation interval (in steps)."""
    drops, interval = [], None
    for c in baseline_curves:
        if c and len(c["steps"]) >= 2 and c["steps"][-1] == steps:
            interval = c["steps"][-1] - c["steps"][-2]
            drops.append(c["value"][-2] - c["value"][-1])
    if not drops or noise.get("sd") is None:
        return {}
    drop = statistics.median(drops)
    return {"end_improvement": drop, "end_interval": interval,
            "crossing_shift_steps": noise["sd"] / drop * interval if drop > 0 else None}
