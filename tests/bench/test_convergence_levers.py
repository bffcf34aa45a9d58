"""The study's post-hoc EMA and alignment arms (bench/convergence_arms.py, convergence_phema.py): their
configs, the combination's additive levers, the tables' post-hoc and held-out rows and the second
evaluator's verdicts on synthetic runs, and the post-hoc curves of a real (tiny) run."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))


def _cfg(arm_name, steps=960, evals=8):
    from convergence import overrides
    from convergence_arms import ARMS

    from fasttrain.configure import load_config

    return load_config("default", overrides("digits", ARMS[arm_name], arm_name, 16, 0, steps, evals))


def test_the_levers_configs():
    from convergence_arms import ARMS

    base, ph, al, rnd = _cfg("baseline"), _cfg("phema"), _cfg("align"), _cfg("align_random")
    assert base.phema.every == 60 and base.eval.every % base.phema.every == 0  # a snapshot at every evaluation
    ph.run_dir = base.run_dir
    assert ph == base and ARMS["phema"].runs == "baseline" and ARMS["phema"].posthoc  # the same runs
    assert list(base.eval.extra_extractors) == ["fasttrain-digits-cnn"]  # the second evaluator in every run
    a = al.diffusion.align
    assert a.encoder.endswith("digits_encoder:encoder") and (a.depth, a.weight, a.encoder_dim) == (3, 0.5, 64)
    assert rnd.diffusion.align.encoder.endswith(":random_encoder")
    assert _cfg("baseline", steps=30, evals=2).phema.every == 15  # an odd interval: every evaluation step still


def _row(median):
    t = {"median": median, "ci": [None, None], "censored": 0, "n": 2, "coverage": 0.0, "verdict": None, "vs": {}}
    return {"targets": {"0.25": t, "0.5": t, "1.0": t}}


def test_the_combination_adds_alignment_and_the_post_hoc_ema_where_they_beat_the_baseline():
    from convergence_arms import ARMS, combination

    arms = {a: ARMS[a] for a in ("mixed_min_snr", "logit_normal", "align", "phema", "align_random")}
    rows = {"mixed_min_snr": _row(2.0), "logit_normal": _row(1.1), "align": _row(1.3), "phema": _row(0.95),
            "align_random": _row(5.0)}  # a diagnostic is never combined
    name, arm = combination(rows, arms)
    assert name == "mixed_min_snr + logit_normal + align" and not arm.posthoc
    assert "diffusion.sampler=logit_normal" in arm.overrides and any("digits_encoder:encoder" in o
                                                                     for o in arm.overrides)
    rows["phema"] = _row(1.2)
    name, arm = combination(rows, arms)
    assert name.endswith("+ phema") and arm.posthoc and arm.snapshots


def _write_run(path: Path, steps, values, values2, extra=None):
    path.mkdir(parents=True)
    rows = [{"step": s, "eval/fid": v, "eval/fid_fasttrain_digits_cnn": w} for s, v, w in zip(steps, values, values2)]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (path / "summary.json").write_text("{}")
    if extra is not None:  # a post-hoc curve beside it, as convergence_phema.make_curve writes it
        pts = [{"step": s, "fid": v, "fid_fasttrain_digits_cnn": w} for s, v, w in zip(steps, *extra)]
        (path / "phema-curve-0.1000.json").write_text(json.dumps({"sigma_rel": 0.1, "eval_n": 8, "points": pts}))


def test_the_table_has_the_post_hoc_row_its_held_out_row_and_the_second_evaluators_verdicts(tmp_path):
    """Synthetic runs: the baseline's fixed-EMA curves, and post-hoc curves of the same runs that reach every
    level in 60% of the steps; its row pairs with the baseline's curve of the same run (vs baseline), its
    held-out row is the null seeds' post-hoc curves, and the second evaluator's FID gets its own verdicts."""
    import convergence
    from convergence_arms import ARMS
    from convergence_design import run_dir

    rng = np.random.default_rng(0)
    steps = [0, 100, 200, 300, 400]
    seeds = list(range(5))
    for s in seeds + [h + 100 for h in seeds]:
        k = 1 + 0.02 * rng.standard_normal()
        base = [100 * math.exp(-x / 150 * k) + 1 for x in steps]
        fast = [100 * math.exp(-x / 90 * k) + 1 for x in steps]
        _write_run(run_dir("digits", 16, "baseline", s, tmp_path), steps, base, [2 * v for v in base],
                   extra=(fast, [2 * v for v in fast]))
    arms = {"baseline": ARMS["baseline"], "phema": ARMS["phema"]}
    rows, info = convergence.table("digits", 16, arms, seeds, 400, tmp_path, None, 0.1)
    assert set(rows) == {"baseline", "null", "phema", "phema_heldout"}
    for name in ("phema", "phema_heldout"):
        t = rows[name]["targets"]["1.0"]
        assert t["median"] > 1.4 and t["verdict"] == "faster", (name, t)
        # paired with the fixed EMA of the same run (at 50%: at 100% half the baselines never reach their median)
        assert rows[name]["targets"]["0.5"]["vs"]["baseline"]["median"] > 1.4 and rows[name]["sigma_rel"] == 0.1
    assert "σ_rel 0.1" in rows["phema_heldout"]["recipe"] and len(rows["phema_heldout"]["curves"]) == 5
    rows2, _ = convergence.table("digits", 16, arms, seeds, 400, tmp_path, None, 0.1,
                                 metric="fid_fasttrain_digits_cnn")
    convergence.attach_second(rows, rows2, "fid_fasttrain_digits_cnn")
    assert rows["phema"]["second"]["targets"]["1.0"]["verdict"] == "faster"
    assert rows["phema"]["second"]["value_at_end_median"] > rows["phema"]["per_seed"][0]["value_at_end"]
    from convergence_report import markdown

    meta = {"machine": {}, "when": "now", "command": "c", "domains": {"digits": {
        "seeds": seeds, "batches": {"16": 400}, "tables": {"16": {**info, "phema": {
            "chosen": 0.1, "metric": "fid", "median_at_end": {"0.05": 3.0, "0.1": 2.0}}}}}}}
    md = markdown({"digits": {"16": rows}}, meta)
    for words in ("post-hoc EMA: σ_rel 0.1 chosen on the main seeds", "0.05 → 3", "| **phema_heldout** |",
                  "2nd evaluator: to 100%", "second evaluator: fid_fasttrain_digits_cnn"):
        assert words in md, words


def test_post_hoc_curves_of_a_tiny_run(tmp_path):
    """A real run with the study's overrides (shortened): every σ_rel evaluated at its end, the choice, and
    the chosen σ_rel's curve at the run's evaluation steps (step 0: the run's own evaluation)."""
    import convergence_phema as cp
    from convergence import overrides
    from convergence_arms import ARMS

    from fasttrain.configure import load_config
    from fasttrain.logger import read_jsonl
    from fasttrain.train import train

    run = tmp_path / "run"
    over = [o for o in overrides("digits", ARMS["baseline"], "baseline", 16, 0, 40, 2, root=tmp_path, eval_n=32)
            if not o.startswith("run_dir=")] + [f"run_dir={run}", "eval.steps=4"]
    train(load_config("default", over))
    choice = cp.choose([run], "fid", 32, sigmas=(0.05, 0.2))
    assert choice["chosen"] in (0.05, 0.2) and set(choice["median_at_end"]) == {"0.05", "0.2"}
    cp.make_curve(run, choice["chosen"], 32)
    c = cp.curve(run, choice["chosen"], "fid")
    own = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/fid" in r]
    assert c["steps"] == [r["step"] for r in own] == [0, 20, 40]
    assert c["value"][0] == own[0]["eval/fid"]  # the initial network: every average equals it
    assert c["value"][-1] == choice["median_at_end"][str(choice["chosen"])]  # the sweep's end value, reused
    second = cp.curve(run, choice["chosen"], "fid_fasttrain_digits_cnn")
    assert len(second["value"]) == 3 and all(v > 0 for v in second["value"])


def test_the_projection_calibrates_on_a_short_invocation_of_this_design():
    """convergence_pilot.calibration: a finished invocation's wall over its plan's units, the table's own
    measured step times in place of the pilot's; an invocation of another design calibrates nothing."""
    import convergence
    from convergence_arms import ARMS, available
    from convergence_design import NOISE_EVALS
    from convergence_phema import SIGMAS
    from convergence_pilot import calibration

    usable = available(ARMS, convergence.has_key)
    table = {"timing": {"ms_per_step": {"baseline": 10.0, "align": 20.0, "phema": 10.0}}}
    saved = {"meta": {"walls": [5000.0], "commands": ["c"], "domains": {"digits": {
        "design": convergence.DESIGN, "seeds": [0, 1], "evals": 4, "eval_n": 512, "batches": {"16": 240},
        "arms": {"16": ["baseline", "phema", "align"]}, "tables": {"16": table}}}}}
    costs = {("digits", 16): {"baseline": 1.0, "align": 1.0, "phema": 1.0}}  # the pilot's: align's own is 2×
    ev, start = 100.0, 300.0
    cal = calibration(saved, usable, costs, {"digits": {512: {"units": ev}}}, {"digits": start})
    per_run = start + 5 * ev  # start-up and the step-0 evaluation + 4
    # baseline, align, the null baseline, the held-out arm (the costliest: align); phema trains nothing
    units = 2 * (4 * per_run + 240 * (1 + 2 + 1 + 2))
    posthoc = 2 * (len(SIGMAS) + 3 + 4) * ev  # every σ_rel at the end, then the curve on the main and null seeds
    wall = (units + posthoc) / 2 + 66 * (1 + 1 + 2) + NOISE_EVALS * ev
    assert cal["runs"] == 8 and cal["run_units"] == pytest.approx(units) and cal["posthoc_units"] == posthoc
    assert cal["seconds_per_unit"] == pytest.approx(5000.0 / wall)
    saved["meta"]["domains"]["digits"]["design"] = convergence.DESIGN - 1
    assert calibration(saved, usable, costs, {"digits": {512: {"units": ev}}}, {"digits": start}) is None
