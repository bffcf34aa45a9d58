"""Post-hoc EMA (EDM2 §3): the profile math against oracles that are not the code under test (numerical
quadrature of the profiles' definition, an explicit EMA recursion), the reconstruction of an EMA that was
tracked directly, and training runs: snapshots, exact resume, the `ema` command and the eval sweep."""
import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from scipy import integrate

from fasttrain import checkpoint as ckpt
from fasttrain.checkpoint import snapshots
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.errors import InvalidInput
from fasttrain.optim import phema
from fasttrain.train import train

TINY = ["model.args.ch=8", "train.progress=false", "sample.num=0", "optim.warmup_steps=5", "train.threads=1",
        "eval.num_samples=0", "eval.bpd=false", "train.log_every=1", "data.batch_size=8", "train.plots=false"]


def profile(tau, gamma, t):
    """EDM2 Eq. 121 (continuous): p(τ) = (γ+1) τ^γ / t^(γ+1) on [0, t], written out here for the oracle."""
    return np.where(tau <= t, (gamma + 1) * np.power(tau, gamma) / t ** (gamma + 1), 0.0)


@pytest.mark.parametrize("s", [0.01, 0.05, 0.1, 0.15, 0.25, 0.28])
def test_sigma_rel_is_the_profiles_std_relative_to_its_time(s):
    g = phema.gamma_of(s)
    assert g > 0 and phema.sigma_rel_of(g) == pytest.approx(s, rel=1e-12)
    t = 7.0  # σ_rel does not depend on t: the profile scales with it
    mass = integrate.quad(lambda x: profile(x, g, t), 0, t, limit=200)[0]
    mean = integrate.quad(lambda x: x * profile(x, g, t), 0, t, limit=200)[0]
    var = integrate.quad(lambda x: (x - mean) ** 2 * profile(x, g, t), 0, t, limit=200)[0]
    assert mass == pytest.approx(1, rel=1e-8)
    assert math.sqrt(var) / t == pytest.approx(s, rel=1e-6)  # EDM2: the std relative to the training time
    assert mean / t == pytest.approx((g + 1) / (g + 2), rel=1e-8)


def test_sigma_rel_outside_the_power_profiles_is_refused():
    for bad in (0, -0.1, phema.SIGMA_REL_MAX, 0.3, float("nan")):
        with pytest.raises(InvalidInput, match="must lie in"):
            phema.gamma_of(bad)


def test_the_inner_products_equal_numerical_integration():
    rng = np.random.default_rng(0)
    for _ in range(12):
        ta, tb = rng.uniform(10, 1000, 2)
        ga, gb = phema.gamma_of(rng.uniform(0.02, 0.25)), phema.gamma_of(rng.uniform(0.02, 0.25))
        m = min(ta, tb)
        want = integrate.quad(lambda x, ga=ga, gb=gb, ta=ta, tb=tb: profile(x, ga, ta) * profile(x, gb, tb), 0, m,
                              limit=400, epsabs=0, epsrel=1e-11)[0]
        assert phema.inner(ta, ga, tb, gb) == pytest.approx(want, rel=1e-8)


def test_coefficients_equal_the_least_squares_solution_by_quadrature():
    """Algorithm 3's system built from quadrature (the oracle) and solved with numpy: the coefficients agree
    to float64 rounding of a well-conditioned system, and sum to one per output."""
    times = [100.0, 200.0, 300.0, 400.0]
    tracked = [0.05, 0.10]
    t_in = [t for t in times for _ in tracked]
    s_in = [s for _ in times for s in tracked]
    outs = [0.03, 0.08, 0.2]
    g_in, g_out = [phema.gamma_of(s) for s in s_in], [phema.gamma_of(s) for s in outs]

    def ip(t1, g1, t2, g2):
        return integrate.quad(lambda x: profile(x, g1, t1) * profile(x, g2, t2), 0, min(t1, t2), limit=400,
                              epsabs=0, epsrel=1e-12)[0]

    A = np.array([[ip(a, ga, b, gb) for b, gb in zip(t_in, g_in)] for a, ga in zip(t_in, g_in)])
    B = np.array([[ip(a, ga, 400.0, go) for go in g_out] for a, ga in zip(t_in, g_in)])
    want = np.linalg.solve(A, B)
    want /= want.sum(0, keepdims=True)
    got = phema.coefficients(t_in, s_in, 400.0, outs).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got.sum(0), 1.0, rtol=0, atol=1e-12)


def test_power_ema_follows_its_recursion():
    """Two updates by hand: β_t = (1 − Δt/t)^(γ+1) (Eq. 127), so the first update takes the weights and the
    second mixes them with weight (1 − (1/2)^(γ+1)) at Δt = 3 images per step."""
    m = torch.nn.Linear(2, 1)
    ema = phema.PowerEMA(m, [0.05, 0.2], images_per_step=3)
    with torch.no_grad():
        m.weight.fill_(2.0)
    ema.update(m)
    w1 = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.fill_(-1.0)
    ema.update(m)
    assert ema.images == 6.0
    for shadow, s in zip(ema.shadows, [0.05, 0.2]):
        g = phema.gamma_of(s)
        beta = (1 - 3 / 6) ** (g + 1)
        torch.testing.assert_close(shadow[0], beta * w1 + (1 - beta) * m.weight.detach())
    other = phema.PowerEMA(torch.nn.Linear(2, 1), [0.05, 0.2])
    other.load_state_dict(ema.state_dict())
    assert other.images == 6.0 and torch.equal(other.shadows[1][0], ema.shadows[1][0])
    with pytest.raises(InvalidInput, match="differs from the checkpoint"):
        phema.PowerEMA(torch.nn.Linear(2, 1), [0.05, 0.1]).load_state_dict(ema.state_dict())


def test_reconstruction_recovers_a_profile_that_was_tracked_directly():
    """A parameter follows a noisy trajectory for 2000 steps; profiles 0.05 and 0.10 are snapshotted every
    100 steps, 0.07 and 0.15 are tracked on the side. Rebuilt from the snapshots alone (the least-squares
    combination), each matches its directly tracked EMA to a small fraction of the trajectory's spread."""
    torch.manual_seed(0)
    steps, every = 2000, 100
    walk = torch.cumsum(torch.randn(steps, 64) * 0.05, 0) + torch.sin(torch.arange(steps)[:, None] / 150.0)
    p = torch.nn.Parameter(torch.zeros(64))
    holder = torch.nn.Module()
    holder.p = p
    tracked = phema.PowerEMA(holder, [0.05, 0.10])
    direct = phema.PowerEMA(holder, [0.07, 0.15])
    times, sig, values = [], [], []
    for k in range(steps):
        with torch.no_grad():
            p.copy_(walk[k])
        tracked.update(holder)
        direct.update(holder)
        if (k + 1) % every == 0:
            for s, sh in zip(tracked.sigma_rels, tracked.shadows):
                times.append(tracked.images)
                sig.append(s)
                values.append(sh[0].clone())
    c = phema.coefficients(times, sig, float(steps), [0.07, 0.15])
    stack = torch.stack(values).double()
    spread = float(walk[-400:].std())
    for j in range(2):
        rebuilt = (c[:, j:j + 1] * stack).sum(0)
        err = float((rebuilt - direct.shadows[j][0].double()).abs().max())
        assert err < 0.05 * spread, (j, err, spread)
    # and not by accident: the two targets differ from each other and from the last tracked profile
    assert float((direct.shadows[0][0] - direct.shadows[1][0]).abs().max()) > 0.2 * spread


# -- training runs ------------------------------------------------------------------------------------------
def _cfg(run, *over):
    return load_config("default", [f"run_dir={run}"] + TINY + list(over))


def test_snapshots_resume_exactly_and_rebuild_a_bundle(tmp_path, capsys):
    common = ["phema.every=3", "train.ckpt_every=0"]
    train(_cfg(tmp_path / "a", "train.steps=10", *common))
    train(_cfg(tmp_path / "b", "train.steps=5", *common))  # its last step (5) is off the grid
    assert [s.step for s in snapshots.find(tmp_path / "b")] == [3, 5]
    train(_cfg(tmp_path / "b", "train.steps=10", *common), resume=True)
    a, b = snapshots.find(tmp_path / "a"), snapshots.find(tmp_path / "b")
    assert [s.step for s in a] == [s.step for s in b] == [3, 6, 9, 10]
    for sa, sb in zip(a, b):
        xa, xb = torch.load(sa.path, weights_only=True), torch.load(sb.path, weights_only=True)
        assert xa["images"] == xb["images"] == sa.step * 8 and xa["sigma_rels"] == [0.05, 0.1]
        for k in ("p0", "p1"):
            for n in xa["shadow"][k]:
                assert torch.equal(xa["shadow"][k][n], xb["shadow"][k][n]), (sa.step, k, n)
    la, lb = (torch.load(r / "last.pt", weights_only=True)["averages"]["phema"]
              for r in (tmp_path / "a", tmp_path / "b"))
    assert la["images"] == lb["images"] == 80.0
    # a snapshot costs (profiles) × 4 bytes × trained parameters, plus its plain part
    n = sum(t.numel() for t in la["shadow"]["p0"].values())
    assert 2 * 4 * n < a[-1].path.stat().st_size < 2 * 4 * n + 200_000
    # fasttrain ema: a bundle that sample and eval read; the tracked profile is reproduced exactly
    assert main(["ema", str(tmp_path / "a"), "--sigma-rel", "0.1", "0.2"]) == 0
    out = tmp_path / "a" / "ema" / "phema-000000010-0.1000.pt"
    assert out.is_file() and str(out) in capsys.readouterr().out
    rec = torch.load(out, weights_only=True)
    snap10 = torch.load(a[-1].path, weights_only=True)["shadow"]["p1"]
    for name, v in snap10.items():
        torch.testing.assert_close(rec["ema"]["shadow"][name], v, rtol=0, atol=2e-6)
    assert rec["train"]["step"] == 10 and rec["phema"]["snapshots"] == [3, 6, 9, 10]
    assert main(["sample", "--ckpt", str(out), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    if importlib.util.find_spec("diffusers") is not None:  # the export reads the reconstruction as a run
        assert main(["export", str(out), "--to", "diffusers", str(tmp_path / "pipe")]) == 0
        assert "weights of step 10" in capsys.readouterr().out
    # reconstructing at an earlier snapshot uses the snapshots up to it
    assert main(["ema", str(tmp_path / "a"), "--sigma-rel", "0.08", "--step", "6", "--out", str(tmp_path / "e")]) == 0
    assert torch.load(tmp_path / "e" / "phema-000000006-0.0800.pt", weights_only=True)["phema"]["snapshots"] == [3, 6]


def test_phema_leaves_training_unchanged(tmp_path):
    """The profiles draw nothing and change nothing the step computes: the same losses and weights."""
    train(_cfg(tmp_path / "a", "train.steps=6"))
    train(_cfg(tmp_path / "b", "train.steps=6", "phema.every=2"))
    from fasttrain.logger import read_jsonl

    la, lb = ([r["loss"] for r in read_jsonl(r / "metrics.jsonl") if "loss" in r] for r in (tmp_path / "a",
                                                                                           tmp_path / "b"))
    assert la == lb and len(la) == 6


def test_resume_refuses_profiles_the_checkpoint_lacks_or_tracked_otherwise(tmp_path, capsys):
    run = tmp_path / "r"
    train(_cfg(run, "train.steps=2"))
    args = ["train", f"run_dir={run}", "train.steps=4", "--resume"] + TINY
    assert main(args + ["phema.every=1"]) == 1
    assert "holds no phema profiles" in capsys.readouterr().err
    train(_cfg(tmp_path / "q", "train.steps=2", "phema.every=1"))
    assert main(["train", f"run_dir={tmp_path / 'q'}", "train.steps=4", "--resume", "phema.every=1",
                 "phema.sigma_rels=[0.05,0.2]"] + TINY) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "phema.sigma_rels=[0.05, 0.2] differs from the checkpoint's" in err[0]


@pytest.mark.parametrize("argv, needle", [
    (["ema", "{run}", "--sigma-rel", "0.3"], "--sigma-rel must be in (0, 0.2887)"),
    (["ema", "{run}", "--sigma-rel", "0.1"], "no post-hoc EMA snapshots"),
    (["eval", "--ckpt", "{run}", "--step", "3"], "--step chooses the snapshot"),
    (["train", "run_dir={run}", "phema.every=2", "phema.sigma_rels=[0.1,0.1]"], "each profile once"),
    (["train", "run_dir={run}", "phema.every=2", "phema.sigma_rels=[0.5]"], "phema.sigma_rels"),
])
def test_bad_post_hoc_ema_input_is_one_line(tmp_path, capsys, argv, needle):
    run = tmp_path / "r"
    if argv[0] != "train":
        train(_cfg(run, "train.steps=2"))
    try:
        code = main([a.format(run=run) for a in argv] + (TINY if argv[0] == "train" else []))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fasttrain: error:") and needle in err[0], err


def test_eval_sweeps_sigma_rel_and_plots_fid(tmp_path, capsys):
    run = tmp_path / "r"
    train(_cfg(run, "train.steps=8", "phema.every=4", "optim.lr=3e-3"))
    assert main(["eval", "--ckpt", str(run), "--sigma-rel", "0.04", "0.2", "--n", "48", "--steps", "3",
                 "--no-bpd"]) == 0
    sweep = json.loads((run / "ema" / "sweep-000000008.json").read_text())
    assert [r["sigma_rel"] for r in sweep["results"]] == [0.04, 0.2]
    fids = [r["fid"] for r in sweep["results"]]
    assert all(f > 0 for f in fids) and fids[0] != fids[1]  # different weights, different samples
    assert sweep["best_sigma_rel"] == [0.04, 0.2][int(np.argmin(fids))]
    assert (run / "ema" / "sweep-000000008.png").stat().st_size > 1000
    assert "σ_rel sweep" in capsys.readouterr().out
    assert ckpt.latest(run) == run / "last.pt"  # the run itself untouched
