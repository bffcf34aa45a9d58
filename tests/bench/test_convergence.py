"""The convergence benchmark's arithmetic on synthetic curves with known answers, and its quick mode."""
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from convergence_lib import Crossing, first_crossing, paired_median_ci, seconds_at, value_at  # noqa: E402


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


def test_paired_intervals_rank_censored_seeds_lowest_and_never_as_their_bound():
    s = paired_median_ci([(3.0, False), (1.0, False), (2.0, False)])
    assert s["median"] == 2.0 and s["censored"] == 0 and 1.0 <= s["ci"][0] <= 2.0 <= s["ci"][1] <= 3.0
    # one censored seed of three: the median is the middle of (censored, 2, 3), i.e. 2
    s = paired_median_ci([(2.0, False), (3.0, False), (math.nan, True)])
    assert s["median"] == 2.0 and s["censored"] == 1 and s["ci"][0] is None and s["ci"][1] == 3.0
    # two of three censored: the median itself is only known to be below the bound
    assert paired_median_ci([(2.0, False), (math.nan, True), (math.nan, True)])["median"] is None
    # ten clearly faster seeds: the whole interval above 1
    s = paired_median_ci([(1.5 + 0.05 * k, False) for k in range(10)])
    assert s["ci"][0] > 1.2 and s["ci"][1] < 2.1 and s["ci"][0] <= s["median"] <= s["ci"][1]
    assert paired_median_ci([])["median"] is None


def test_the_edm2_arm_trains_with_edm2s_sampler_weighting_and_log_variance_layer():
    """The table names the recipe; the config the arm runs turns exactly that on."""
    from convergence import DOMAINS, overrides
    from convergence_arms import ARMS

    from fasttrain.bundle import DataSpec, build_network
    from fasttrain.configure import load_config

    arm = ARMS["edm2"]
    cfg = load_config("default", overrides("digits", arm, "edm2", 16, 0, 100, 10))
    d = cfg.diffusion
    assert (d.sampler, d.sampler_args.p_mean, d.sampler_args.p_std) == ("lognormal", -0.8, 1.6)
    assert (d.weighting, d.weighting_args.sigma_data, d.prediction) == ("edm", 0.5, "v")
    assert d.learned_weighting and d.logvar_layer == "edm2"
    assert cfg.optim.grad_clip == 0 and list(cfg.optim.betas) == [0.9, 0.99]
    for words in ("log-normal", "EDM weighting", "MPConv", "no gradient clipping"):
        assert words in arm.recipe
    net = build_network(cfg, DataSpec("digits", 1, 8, 10, 0.1))
    assert net.logvar is not None and net.logvar.layer == "edm2"
    assert "edm2" not in DOMAINS["digits"]["base"]


def test_clock_and_values_at_fractional_steps():
    assert seconds_at(150, [0, 100, 200], [0.0, 10.0, 30.0]) == 20.0
    assert value_at(250, [200, 300], [6.0, 2.0]) == 4.0
    with pytest.raises(ValueError, match="must increase"):
        first_crossing([2, 1], [1.0, 1.0], 1.0)


@pytest.mark.slow
def test_quick_mode_writes_the_table_and_the_plot(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "convergence.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for f in ("convergence.json", "convergence.md", "convergence-digits.png"):
        assert (tmp_path / f).is_file(), f
    table = (tmp_path / "convergence.md").read_text()
    assert "| baseline |" in table and "1.00 [1.00, 1.00]" in table and "| min_snr_eps |" in table


def _fake_analyse(domain, batch, arms, seeds, steps, cost):
    t = {"ratio_median": 1.0, "ratio_ci90": [1.0, 1.0], "censored": 0, "seeds": len(seeds), "per_seed": [],
         "vs_control": None}
    return {a: {"recipe": arm.recipe, "source": arm.source, "control": arm.control, "seeds": len(seeds),
                "targets": {"0.25": t, "0.5": t, "1.0": t}, "per_seed": [], "curves": {}, "steps": steps}
            for a, arm in arms.items()}


def test_invocations_add_arms_to_a_table_of_the_same_design_and_drop_tables_of_another(tmp_path, monkeypatch):
    """--arms with --resume adds to a batch's table; other steps, seeds or evaluations start it over."""
    import json

    import convergence

    monkeypatch.setattr(convergence, "run_grid", lambda *a, **k: None)  # no training: the bookkeeping only
    monkeypatch.setattr(convergence, "analyse", _fake_analyse)
    monkeypatch.setattr(convergence, "run_costs", lambda *a, **k: {})

    def run(*extra):
        convergence.main(["--domain", "checkerboard", "--seeds", "2", "--no-timing", "--out", str(tmp_path), *extra])
        saved = json.loads((tmp_path / "convergence.json").read_text())
        return saved["results"]["checkerboard"], saved["meta"]

    tables, _ = run("--arms", "min_snr_eps")
    assert list(tables) == ["128"] and list(tables["128"]) == ["baseline", "min_snr_eps"]
    tables, meta = run("--arms", "speed", "--resume")
    assert list(tables["128"]) == ["baseline", "min_snr_eps", "speed"]
    assert meta["domains"]["checkerboard"]["arms"]["128"] == ["baseline", "min_snr_eps", "speed"]
    assert len(meta["commands"]) == 2 and len(meta["walls"]) == 2
    tables, _ = run("--arms", "logit_normal", "--resume", "--steps", "300")  # another horizon
    assert list(tables["128"]) == ["baseline", "logit_normal"] and tables["128"]["baseline"]["steps"] == 300
    tables, meta = run("--arms", "speed", "--resume", "--steps", "300", "--evals", "4")  # another design
    assert list(tables["128"]) == ["baseline", "speed"] and meta["domains"]["checkerboard"]["evals"] == 4
    tables, _ = run("--arms", "min_snr_v", "--steps", "300", "--evals", "4")  # without --resume: a new table
    assert list(tables["128"]) == ["baseline", "min_snr_v"]
