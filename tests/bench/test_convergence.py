"""The convergence benchmark: its arithmetic on curves with known answers, the target rule and the null
row on synthetic curves (a pure-noise arm gets an arrow no more often than the interval allows), the
arms' controls, the argument checks and result writes, and its quick mode."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from convergence_lib import (  # noqa: E402
    Crossing,
    coverage,
    first_crossing,
    median_interval,
    order_statistic_rank,
    ratio_bounds,
    seconds_at,
    value_at,
)


def test_crossing_interpolates_between_evaluations():
    c = first_crossing([100, 200, 300], [10.0, 6.0, 2.0], 4.0)
    assert c == Crossing(250.0, False)  # 6 → 2 between 200 and 300: 4 is reached halfway
    assert first_crossing([100, 200], [10.0, 3.0], 10.0) == Crossing(100.0, False)  # a tie at an evaluation counts


def test_crossing_takes_the_first_of_several_and_censors_a_curve_that_never_gets_there():
    assert first_crossing([1, 2, 3, 4], [5.0, 1.0, 6.0, 0.5], 2.0).steps == pytest.approx(1 + 3 / 4)
    never = first_crossing([100, 200, 300], [9.0, 8.0, 7.5], 5.0)
    assert never.censored and never.steps == 300
    assert first_crossing([1, 2], [float("nan"), 1.0], 2.0) == Crossing(2.0,
                                                                        False)  # a NaN evaluation is not a crossing


def test_ratios_and_bounds():
    base = Crossing(3000, False)
    assert Crossing(1000, False).ratio_to(base) == (3.0, "=")
    r, kind = Crossing(3000, True).ratio_to(base)  # the arm never got there: at most 1×
    assert r == 1.0 and kind == "<"
    r, kind = Crossing(1500, False).ratio_to(Crossing(3000, True))  # the baseline never did: at least 2×
    assert r == 2.0 and kind == ">"
    assert math.isnan(Crossing(5, True).ratio_to(Crossing(5, True))[0])
    assert Crossing(0, False).ratio_to(Crossing(0, False)) == (1.0, "=")  # both at the first evaluation: a tie
    assert ratio_bounds(Crossing(1000, False), base) == (3.0, 3.0)
    lo, hi = ratio_bounds(Crossing(4000, True), base)  # below 3000/4000: its steps exceed its last one
    assert lo == 0.0 and hi < 0.75 and hi == pytest.approx(0.75)
    lo, hi = ratio_bounds(Crossing(1500, False), Crossing(3000, True))
    assert lo > 2.0 and lo == pytest.approx(2.0) and hi == math.inf
    assert ratio_bounds(Crossing(4000, True), Crossing(3000, True)) == (0.0, math.inf)


def test_the_interval_is_the_order_statistic_interval_and_takes_the_unfavourable_bound_of_censored_seeds():
    assert [order_statistic_rank(n) for n in (4, 5, 10, 20)] == [0, 1, 2, 6]
    assert coverage(10, 2) == pytest.approx(1 - 2 * 11 / 1024) and coverage(5, 1) == pytest.approx(1 - 2 / 32)
    ten = [(1.5 + 0.05 * k, 1.5 + 0.05 * k) for k in range(10)]
    s = median_interval(ten)
    assert s["ci"] == [pytest.approx(1.55), pytest.approx(1.9)] and s["median"] == pytest.approx(1.725)
    assert s["faster"] == 10 and s["censored"] == 0 and s["coverage"] > 0.97
    assert median_interval(ten[:5])["ci"] == [1.5, pytest.approx(1.7)]  # 5 seeds: the smallest to the largest
    assert median_interval(ten[:4])["ci"] == [None, None] and median_interval(ten[:4])["coverage"] == 0
    # two seeds whose arm never got there: the lower end falls to the 2nd lowest bound (0: "cens."), the upper end
    # takes their upper bounds, which are below every reached ratio here
    s = median_interval([(0.0, 0.9), (0.0, 0.95)] + ten[2:])
    assert s["ci"][0] is None and s["ci"][1] == pytest.approx(1.9) and s["censored"] == 2 and s["slower"] == 2
    # a baseline that never got there: above its bound, so it helps the lower end and leaves the upper one open
    s = median_interval([(1.6, math.inf)] * 2 + ten[2:])
    assert s["ci"][0] == pytest.approx(1.6) and s["ci"][1] is None and s["ci_bound"] == [True, True]
    assert median_interval([(0.0, math.inf)] * 6 + ten[:4])["median"] is None  # the censoring decides it
    assert median_interval([])["median"] is None


def test_clock_and_values_at_fractional_steps():
    assert seconds_at(150, [0, 100, 200], [0.0, 10.0, 30.0]) == 20.0
    assert value_at(250, [200, 300], [6.0, 2.0]) == 4.0
    with pytest.raises(ValueError, match="must increase"):
        first_crossing([2, 1], [1.0, 1.0], 1.0)


# -- the target rule and the null row on synthetic curves ---------------------------------------------
STEPS, EVALS = 800, 8


def _curve(rng, speed=1.0, sd=0.03):
    """A run: 0.1 + exp(−step/τ) with a seed's own τ (training luck) and evaluation noise; `speed` scales the
    steps, so an arm with speed 1.5 gets anywhere in 1/1.5 of the baseline's steps."""
    x = np.array([STEPS * k // EVALS for k in range(EVALS + 1)])
    tau = 250 * math.exp(0.15 * rng.standard_normal()) / speed
    return {"steps": x.tolist(), "value": (0.1 + np.exp(-x / tau) + sd * rng.standard_normal(len(x))).tolist()}


def _table(rng, speeds: dict, n=10, confirm=None):
    from convergence_analysis import analyse_table
    from convergence_arms import Arm

    seeds, nulls = list(range(n)), list(range(100, 100 + n))
    curves = {"baseline": {s: _curve(rng) for s in seeds + nulls}}
    arms = {"baseline": Arm((), "base", "", "")}
    for name, v in speeds.items():
        curves[name] = {s: _curve(rng, v) for s in seeds + (nulls if name == confirm else [])}
        arms[name] = Arm((), "weighting", name, "synthetic", controls=tuple(c for c in speeds if c != name)[:1])
    return analyse_table(curves, arms, seeds, nulls, STEPS, (0.25, 0.5, 1.0), confirm)


def test_targets_are_the_median_baseline_run_not_a_seeds_own_last_evaluation():
    from convergence_analysis import targets

    rng = np.random.default_rng(0)
    runs = [_curve(rng) for _ in range(20)]
    tg = targets(runs, STEPS, (0.25, 0.5, 1.0))
    for f, t in tg.items():
        at = sorted(value_at(float(f) * STEPS, c["steps"], c["value"]) for c in runs)
        assert at[9] <= t <= at[10]  # half the baseline runs are at or below it at f·steps
    runs[0]["value"][-1] = -5.0  # one run's wild last evaluation barely moves the 100% target
    assert abs(targets(runs, STEPS, (1.0,))["1.0"] - tg["1.0"]) <= at[10] - at[9]
    rows, info = _table(rng, {"arm": 1.0})
    assert info["targets"].keys() == {"0.25", "0.5", "1.0"} and info["targets"]["0.25"] > info["targets"]["1.0"]
    base = rows["baseline"]["targets"]
    assert all(base[f]["median"] == 1.0 and base[f]["ci"] == [1.0, 1.0] for f in base)  # the reference, exactly
    # about half of the independent baseline runs get to the 100% target only at the very end or not at all:
    # the null row is censored there and gets no arrow
    null = rows["null"]["targets"]["1.0"]
    assert null["censored"] >= 2 and null["verdict"] is None and null["n"] == 10


def test_a_pure_noise_arm_gets_an_arrow_no_more_often_than_the_intervals_level():
    from convergence_analysis import verdict

    rng = np.random.default_rng(1)
    reps, arrows, unguarded = 150, {f: 0 for f in ("0.25", "0.5", "1.0")}, 0
    for _ in range(reps):
        rows, _ = _table(rng, {"noise": 1.0})
        for f in arrows:
            arrows[f] += rows["noise"]["targets"][f]["verdict"] is not None
            unguarded += verdict(rows["noise"]["targets"][f], None) is not None
    for f, k in arrows.items():  # the interval covers the median with ≥ 90% (97.9% at 10 seeds): ≤ 10% arrows
        assert k / reps <= 0.10, (f, k)
    assert unguarded >= sum(arrows.values())  # beating the null's median only ever removes arrows
    # and the rule is not blind: an arm 1.6× faster (slower) gets ↑ (↓) at the first two targets nearly always
    for speed, want in ((1.6, "faster"), (1 / 1.6, "slower")):
        hits = sum(_table(rng, {"arm": speed})[0]["arm"]["targets"][f]["verdict"] == want
                   for _ in range(20) for f in ("0.25", "0.5"))
        assert hits >= 36, (speed, hits)


def test_controls_and_the_held_out_confirmation_on_synthetic_curves():
    from convergence_analysis import strongest

    rng = np.random.default_rng(2)
    rows, _ = _table(rng, {"fast": 1.8, "plain": 1.0}, confirm="fast")
    assert strongest(rows, ["fast", "plain"]) == "fast"
    assert rows["fast"]["targets"]["0.5"]["vs"]["plain"]["verdict"] == "faster"  # against its control as well
    held = rows["heldout"]["targets"]["0.5"]
    assert held["n"] == 10 and held["verdict"] == "faster"  # on seeds it was not chosen on
    assert [p["seed"] for p in rows["heldout"]["per_seed"]] == list(range(100, 110))


# -- the arms ------------------------------------------------------------------------------------------------
def _leaves(cfg):
    from omegaconf import OmegaConf

    def walk(d, p=""):
        for k, v in d.items():
            yield from walk(v, f"{p}{k}.") if isinstance(v, dict) else [(f"{p}{k}", v)]
    return dict(walk(OmegaConf.to_container(cfg, resolve=True)))


def test_each_arm_differs_from_its_controls_in_one_knob():
    from convergence import overrides
    from convergence_arms import ARMS

    from fasttrain.configure import load_config

    knob = lambda k: "optim" if k.startswith("optim.") else k  # the optimizer's settings are one knob
    resolved = {a: _leaves(load_config("default", overrides("digits", arm, "x", 16, 0, 100, 10)))
                for a, arm in ARMS.items()}
    checked = 0
    for name, arm in ARMS.items():
        for c in arm.controls:
            diff = {knob(k) for k in resolved[name] if resolved[name][k] != resolved[c].get(k)}
            if arm.runs == c:  # the post-hoc EMA: the control's own runs, averaged otherwise (the knob is not a key)
                assert diff == set() and arm.posthoc, (name, c, diff)
                continue
            assert len(diff) == 1, (name, c, diff)
            checked += 1
    assert checked >= 4
    assert ARMS["mixed_min_snr"].controls == ("min_snr_eps", "min_snr_v")
    noaux = resolved["mixed_min_snr_noaux"]
    assert noaux["diffusion.mixed.aux_weight"] == 0 and resolved["mixed_min_snr"]["diffusion.mixed.aux_weight"] > 0


def test_the_edm2_arms_separate_the_recipe_from_its_optimizer():
    """The table names the recipe; the config the arm runs turns exactly that on, under the baseline's
    optimizer; EDM2's optimizer settings are an arm of their own, and the two together another."""
    from convergence import DOMAINS, overrides
    from convergence_arms import ARMS

    from fasttrain.bundle import DataSpec, build_network
    from fasttrain.configure import load_config

    cfg = lambda a: load_config("default", overrides("digits", ARMS[a], a, 16, 0, 100, 10))
    base, edm2, opt, full = cfg("baseline"), cfg("edm2"), cfg("edm2_optimizer"), cfg("edm2_full")
    d = edm2.diffusion
    assert (d.sampler, d.sampler_args.p_mean, d.sampler_args.p_std) == ("lognormal", -0.8, 1.6)
    assert (d.weighting, d.weighting_args.sigma_data, d.prediction) == ("edm", 0.5, "v")
    assert d.learned_weighting and d.logvar_layer == "edm2"
    assert edm2.optim == base.optim and full.diffusion == edm2.diffusion and opt.diffusion == base.diffusion
    for c in (opt, full):
        assert c.optim.grad_clip == 0 and list(c.optim.betas) == [0.9, 0.99]
    for words in ("log-normal", "EDM weighting", "MPConv", "the baseline's optimizer"):
        assert words in ARMS["edm2"].recipe
    net = build_network(edm2, DataSpec("digits", 1, 8, 10, 0.1))
    assert net.logvar is not None and net.logvar.layer == "edm2"
    assert "edm2" not in DOMAINS["digits"]["base"]
    runs = overrides("digits", ARMS["baseline"], "baseline", 16, 3, 960, 8)
    assert "eval.at_start=true" in runs and "eval.seed=3" in runs and "eval.every=120" in runs


def test_the_mixed_arm_without_its_aux_terms_trains(tmp_path):
    from convergence import overrides
    from convergence_arms import ARMS

    from fasttrain.configure import load_config
    from fasttrain.logger import read_jsonl
    from fasttrain.train import train

    over = [o for o in overrides("checkerboard", ARMS["mixed_min_snr_noaux"], "x", 64, 0, 6, 1)
            if not o.startswith(("run_dir=", "eval."))]
    train(load_config("default", over + [f"run_dir={tmp_path}", "eval.num_samples=0", "train.log_every=2",
                                         "model.args.hidden=32"]))
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("loss") is not None]
    assert len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in losses)


# -- the command: arguments, invocations, result writes -------------------------------------------------------
def _error(capsys, fn) -> str:
    """The one line a bad invocation ends with: argparse's (SystemExit) or a UserError's."""
    from fasttrain.errors import UserError

    try:
        fn()
    except SystemExit as e:
        return capsys.readouterr().err.strip() or str(e.code)
    except UserError as e:
        return str(e)
    pytest.fail("no error")


@pytest.mark.parametrize("argv, words", [
    (["--domain", "Digits"], "unknown domain 'Digits'"),
    (["--evals", "0"], "argument --evals: must be >= 1, got 0"),
    (["--parallel", "0"], "argument --parallel: must be >= 1"),
    (["--seeds", "0"], "argument --seeds: must be >= 1"),
    (["--seeds", "101"], "--seeds must be at most 100"),
    (["--steps", "0"], "argument --steps: must be >= 1"),
    (["--steps", "4", "--evals", "8"], "--evals 8 is more than the 4 steps"),
    (["--evals", "x"], "must be an integer, got 'x'"),
    (["--batches", "32"], "selects no table"),
    (["--domain", "checkerboard", "--batches", "16"], "selects no table"),
    (["--batches", "sixteen"], "argument --batches: must be an integer"),
    (["--arms", "nope"], "unknown or unavailable arm 'nope'"),
    (["--full", "--arms", "speed"], "either --full or --arms"),
])
def test_bad_arguments_are_one_line_errors_that_write_nothing(tmp_path, monkeypatch, capsys, argv, words):
    import convergence

    monkeypatch.setattr(convergence, "run_grid", lambda *a, **k: pytest.fail("ran"))
    out = tmp_path / "out"
    msg = _error(capsys, lambda: convergence.main(argv + ["--out", str(out)]))
    assert words in msg and "\n" not in msg
    assert not out.exists()


def test_the_default_the_full_set_and_their_projected_runs():
    """The default judges every digits arm on ≥ 10 seeds; --full adds every other arm and the batch-4 table;
    --batches picks a full-set table alone; the pilot counts the runs the study will start."""
    import convergence
    from convergence_arms import ARMS, available
    from convergence_phema import SIGMAS
    from convergence_pilot import plan_units

    usable = available(ARMS, convergence.has_key)
    default = convergence.select(convergence.parse([]), usable)
    assert {d: list(p[0]) for d, p in default.items()} == {"digits": [16], "checkerboard": [128]}
    digits16 = set(default["digits"][2][16])
    assert len(default["digits"][1]) >= 10 and {"mixed_min_snr", "min_snr_v", "min_snr_eps", "phema", "align",
                                                 "align_random", "logit_normal", "loss_second_moment",
                                                 "adaptive_official", "edm2_learned_alone", "input_perturbation",
                                                 "pseudo_huber_snr", "immiscible"} <= digits16
    full = convergence.select(convergence.parse(["--full"]), usable)
    assert list(full["digits"][0]) == [16, 4] and set(full["digits"][2][16]) == set(usable)
    small = convergence.select(convergence.parse(["--domain", "digits", "--batches", "4"]), usable)
    assert list(small) == ["digits"] and list(small["digits"][0]) == [4] and "mixed_snr" in small["digits"][2][4]
    costs = {(d, b): {a: 1.0 for a in usable} for d, p in full.items() for b in p[0]}
    proj = plan_units(default, costs, {"digits": {512: {"units": 100.0}}, "checkerboard": {4000: {"units": 50.0}}},
                      {"digits": 300.0, "checkerboard": 100.0}, 8, {"digits": 512, "checkerboard": 4000})
    # per seed: every arm that trains (not phema: the baseline's runs), the combination (stage 2), the baseline on
    # the null seed, and on digits the held-out arm; phema's evaluations: every σ_rel at the end, then its curve
    trained = len(digits16) - 1
    assert proj["runs"] == 10 * (trained + 1 + 1 + 1) + 10 * (5 + 1)
    assert proj["run_units"] == pytest.approx(10 * (trained + 3) * (300 + 960 + 9 * 100) + 60 * (100 + 600 + 9 * 50))
    assert proj["posthoc_units"] == pytest.approx(10 * (len(SIGMAS) + 7 + 8) * 100)


def test_out_must_not_be_a_file(tmp_path, capsys):
    import convergence

    f = tmp_path / "results.txt"
    f.write_text("mine")
    assert "is a file; give a folder" in _error(capsys, lambda: convergence.main(["--out", str(f)]))
    assert f.read_text() == "mine"


def _fake_table(domain, batch, arms, seeds, steps, root, confirm, sigma=None, metric=None):
    t = {"median": 1.0, "ci": [1.0, 1.0], "censored": 0, "n": len(seeds), "coverage": 1.0, "verdict": None, "vs": {}}
    rows = {a: {"recipe": arm.recipe, "source": arm.source, "controls": [], "seeds": len(seeds), "curves": {},
                "targets": {"0.25": t, "0.5": t, "1.0": t}, "per_seed": [], "steps": steps}
            for a, arm in arms.items()}
    return rows, {"targets": {"0.25": 3.0, "0.5": 2.0, "1.0": 1.0}}


def _no_training(monkeypatch):
    import convergence

    monkeypatch.setattr(convergence, "run_grid", lambda *a, **k: [])  # no training: the bookkeeping only
    monkeypatch.setattr(convergence, "table", _fake_table)
    monkeypatch.setattr(convergence, "run_costs", lambda runs: {a: 0.01 for a in runs})
    return convergence


def test_invocations_add_arms_to_a_table_of_the_same_design_and_drop_tables_of_another(tmp_path, monkeypatch):
    """--arms with --resume adds to a batch's table; other steps, seeds or evaluations start it over."""
    convergence = _no_training(monkeypatch)

    def run(*extra):
        convergence.main(["--domain", "checkerboard", "--seeds", "2", "--no-timing", "--out", str(tmp_path), *extra])
        saved = json.loads((tmp_path / "convergence.json").read_text())
        return saved["results"]["checkerboard"], saved["meta"]

    tables, _ = run("--arms", "min_snr_eps")
    assert list(tables) == ["128"] and list(tables["128"]) == ["baseline", "min_snr_eps"]
    tables, meta = run("--arms", "speed", "--resume")
    assert list(tables["128"]) == ["baseline", "min_snr_eps", "speed"]
    assert meta["domains"]["checkerboard"]["arms"]["128"] == ["baseline", "min_snr_eps", "speed"]
    assert len(meta["commands"]) == 2 and len(meta["walls"]) == 2 and len(meta["packages"]) == 2
    # one timing per table, of every arm in it (not only this invocation's), from which both columns come
    assert set(meta["domains"]["checkerboard"]["tables"]["128"]["timing"]["ms_per_step"]) == set(tables["128"])
    tables, _ = run("--arms", "logit_normal", "--resume", "--steps", "300")  # another horizon
    assert list(tables["128"]) == ["baseline", "logit_normal"] and tables["128"]["baseline"]["steps"] == 300
    tables, meta = run("--arms", "speed", "--resume", "--steps", "300", "--evals", "4")  # another design
    assert list(tables["128"]) == ["baseline", "speed"] and meta["domains"]["checkerboard"]["evals"] == 4
    tables, _ = run("--arms", "min_snr_v", "--steps", "300", "--evals", "4")  # without --resume: a new table
    assert list(tables["128"]) == ["baseline", "min_snr_v"]


def test_the_combination_is_chosen_once_per_table_and_kept_when_another_table_is_added(tmp_path, monkeypatch):
    convergence = _no_training(monkeypatch)

    def run(*extra):
        convergence.main(["--domain", "digits", "--seeds", "2", "--no-timing", "--full", "--out", str(tmp_path),
                          *extra])
        return json.loads((tmp_path / "convergence.json").read_text())

    saved = run("--batches", "16")
    info = saved["meta"]["domains"]["digits"]["tables"]["16"]
    combo = info["combination"]
    assert " + " in combo["name"] and "combination" in saved["results"]["digits"]["16"]
    assert info["confirm"] in saved["results"]["digits"]["16"]  # the strongest arm, then on the null seeds
    saved = run("--batches", "4", "--resume")  # a table without a sampler arm: nothing to combine there
    assert saved["meta"]["domains"]["digits"]["tables"]["16"]["combination"] == combo
    assert "combination" in saved["meta"]["domains"]["digits"]["arms"]["16"]
    assert list(saved["results"]["digits"]) == ["16", "4"] and "combination" not in saved["results"]["digits"]["4"]


def test_resuming_over_results_of_an_earlier_design_starts_afresh(tmp_path, monkeypatch):
    convergence = _no_training(monkeypatch)
    old = {"meta": {"commands": ["bench/convergence.py"], "walls": [4654.0], "domains": {"digits": {"seeds": [0, 1],
                                                                                                   "evals": 8}}},
           "results": {"digits": {"16": {"baseline": {}}}}}  # the previous design's layout: no "design" key
    (tmp_path / "convergence.json").write_text(json.dumps(old))
    convergence.main(["--resume", "--domain", "checkerboard", "--seeds", "2", "--arms", "speed", "--no-timing",
                      "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert list(saved["results"]) == ["checkerboard"] and len(saved["meta"]["commands"]) == 1
    assert list(saved["results"]["checkerboard"]["128"]) == ["baseline", "speed"]


def test_results_are_replaced_only_by_a_complete_run(tmp_path, monkeypatch):
    convergence = _no_training(monkeypatch)
    import convergence_report
    from convergence_runs import Job

    argv = ["--domain", "checkerboard", "--seeds", "2", "--no-timing", "--arms", "speed", "--out", str(tmp_path)]
    convergence.main(argv)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    assert set(before) == {"convergence.json", "convergence.md", "convergence-checkerboard.png"}
    monkeypatch.setattr(convergence, "run_grid", lambda *a, **k: [Job(tmp_path / "r" / "seed0", (), 1.0)])
    with pytest.raises(SystemExit, match="runs failed .* unchanged"):  # a run failed: nothing replaced
        convergence.main(argv)
    monkeypatch.setattr(convergence, "run_grid", lambda *a, **k: [])
    monkeypatch.setattr(convergence_report, "plot", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the outputs failed part way: nothing replaced, nothing left over
        convergence.main(argv)
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before


def test_the_report_renders_the_null_row_noise_controls_and_held_out_rows(tmp_path):
    from _env import Results
    from convergence import attach_costs
    from convergence_report import write_outputs

    rng = np.random.default_rng(3)
    rows, info = _table(rng, {"fast": 1.8, "plain": 1.0}, confirm="fast")
    for name, r in rows.items():
        r.update(recipe=f"recipe of {name}", source="synthetic", curves={0: _curve(rng)})
    attach_costs(rows, {"baseline": 0.010, "fast": 0.020, "plain": 0.010}, "fast")
    assert rows["fast"]["seconds_ratio_median"] == pytest.approx(rows["fast"]["targets"]["1.0"]["median"] / 2)
    noise = {"metric": "sw2", "eval_n": 4000, "evals": 8, "mean": 0.08, "sd": 0.003, "floor_mean": 0.035,
             "floor_sd": 0.01, "batch": 128, "end_improvement": 0.01, "end_interval": 75,
             "crossing_shift_steps": 22.5}
    meta = {"machine": {"cpu": "test"}, "when": "now", "command": "c", "commands": ["c"], "walls": [60.0],
            "packages": [{"commit": "abc", "modified": False}], "null_offset": 100,
            "domains": {"checkerboard": {"seeds": list(range(10)), "evals": 8, "eval_n": 4000, "metric": "sliced W2",
                                         "batches": {"128": 800}, "noise": noise,
                                         "tables": {"128": {**info, "confirm": "fast",
                                                            "timing": {"how": "side by side", "when": "now"}}}}}}
    with Results(tmp_path) as res:
        write_outputs({"checkerboard": {"128": rows}}, meta, res)
    md = (tmp_path / "convergence.md").read_text()
    for words in ("| **null** |", "| **heldout** |", "vs plain", "0.08 ± 0.003", "about 22 steps", "0.0350 ± 0.0100",
                  "targets (25/50/100%): ", "held-out confirmation: fast", "10 seeds: the 2nd smallest to the 2nd "
                  "largest, 97.9%", "abc for every invocation", "| 20.0 |"):
        assert words in md, words
    assert "- **fast**: faster to the 25%" in md and "- **null**" not in md
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["results"]["checkerboard"]["128"]["null"]["targets"]["1.0"]["n"] == 10
    assert (tmp_path / "convergence-checkerboard.png").is_file()


def test_verdicts_in_words_follow_the_arrows():
    from convergence_report import phrase

    t = lambda v, vs=None: {"verdict": v, "vs": vs or {}}
    assert phrase({"targets": {"0.25": t(None), "0.5": t(None), "1.0": t(None)}}) == \
        "indistinguishable from the baseline at this scale"
    row = {"targets": {"0.25": t("faster"), "0.5": t("faster"), "1.0": t(None, {"min_snr_v": {"verdict": None}})}}
    assert phrase(row) == ("faster to the 25%, 50% targets; indistinguishable from the baseline at 100%; against "
                           "min_snr_v: indistinguishable at 100%")
    assert phrase({"targets": {"0.25": t(None), "0.5": t("slower"), "1.0": t("slower")}}) == \
        "slower to the 50%, 100% targets; indistinguishable from the baseline at 25%"


@pytest.mark.slow
def test_quick_mode_writes_the_table_and_the_plot(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "convergence.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for f in ("convergence.json", "convergence.md", "convergence-digits.png"):
        assert (tmp_path / f).is_file(), f
    table = (tmp_path / "convergence.md").read_text()
    assert "| baseline |" in table and "1.00 [1.00, 1.00]" in table and "| min_snr_eps |" in table
    assert "| **null** |" in table and "metric noise at a fixed network" in table
    curves = json.loads((tmp_path / "convergence.json").read_text())["results"]["digits"]["16"]["baseline"]["curves"]
    assert curves["0"]["steps"][0] == 0  # evaluated at step 0
