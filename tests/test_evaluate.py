"""Bits/dim against analytic values, FID sanity, the digits feature extractor, and the eval/sample/
report commands on a tiny checkpoint."""
import json
import math

import pytest
import torch

from fasttrain.cli import main
from fasttrain.data.builtin import digits
from fasttrain.diffusion.schedule import NoiseSchedule
from fasttrain.evaluate import _log_discretized_gaussian, fidelity, nelbo_bits_per_dim
from fasttrain.features import judge

from gmm_oracle import OracleModel, log_density, sample as gmm_sample


def logsnr_schedule(T, hi=10.0, lo=-10.0):
    """Steps uniform in log-SNR: the discrete-time bound approaches the continuous one as T grows."""
    lam = torch.linspace(hi, lo, T, dtype=torch.float64)
    return NoiseSchedule("logsnr", torch.sigmoid(lam).sqrt(), torch.sigmoid(-lam).sqrt())


class GaussOracle(torch.nn.Module):
    """Exact eps-prediction for data N(0, v·I)."""

    def __init__(self, s, v):
        super().__init__()
        self.a, self.s, self.v = s.alpha, s.sigma, v

    def forward(self, x, t, y=None):
        a, s = self.a[t][:, None], self.s[t][:, None]
        x0 = a * self.v / (a * a * self.v + s * s) * x.double()
        return ((x.double() - a * x0) / s).float()


def test_bpd_of_gaussian_data_matches_the_analytic_bound_and_entropy():
    v, T = 0.3, 2000
    s = logsnr_schedule(T)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2, generator=g, dtype=torch.float64) * math.sqrt(v)
    r = nelbo_bits_per_dim(GaussOracle(s, v), s, "eps", x, n_t=400, discrete=False, generator=g)
    snr = s.snr
    mmse = v / (1 + v * snr)  # E‖x0 - E[x0|x_i]‖² per dimension
    exact_diffusion = (0.5 * (snr[:-1] - snr[1:]) * mmse[1:]).sum().item() / math.log(2)
    assert r["diffusion"] == pytest.approx(exact_diffusion, rel=0.01)
    entropy = 0.5 * math.log(2 * math.pi * math.e * v) / math.log(2)
    assert entropy - 0.01 < r["bpd"] < entropy + 0.04  # a bound, tight up to the time discretisation


def test_bpd_of_the_exact_mixture_denoiser_is_close_to_the_true_nll():
    g = torch.Generator().manual_seed(1)
    x = gmm_sample(1500, g)
    nll = -log_density(x).mean().item() / (2 * math.log(2))
    gaps = []
    for T in (500, 2000):
        s = logsnr_schedule(T)
        r = nelbo_bits_per_dim(OracleModel(s, "v"), s, "v", x, n_t=200, discrete=False, generator=g)
        gaps.append(r["bpd"] - nll)
    assert -0.02 < gaps[1] < 0.1, gaps
    assert gaps[1] < gaps[0]  # finer time steps tighten the bound


def test_discretized_gaussian_is_a_distribution_over_256_levels():
    centres = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in ((0.1, -2.0), (-0.95, -4.0), (0.999, -1.0)):
        lp = _log_discretized_gaussian(centres, torch.full_like(centres, mean), torch.full_like(centres, log_scale))
        assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-9)


def test_fid_is_zero_on_itself_and_large_when_shifted():
    x, _ = digits(8, "train")
    same = fidelity(x, x, "fasttrain-digits", prc=True)
    assert abs(same["fid"]) < 1e-3
    assert same["precision"] > 0.99 and same["recall"] > 0.99
    shifted = fidelity(torch.roll(x, 3, dims=3), x, "fasttrain-digits", prc=False)
    assert shifted["fid"] > 5
    # two halves of the same data (KID is unbiased, so near 0; the set has some exact duplicates)
    halves = fidelity(x[::2], x[1::2], "fasttrain-digits", prc=False)
    assert shifted["kid"] > 10 * abs(halves["kid"]) and halves["fid"] < shifted["fid"] / 5


def test_digit_classifier_recognises_held_out_digits():
    x, y = digits(8, "test")
    r = judge(x, y)
    assert r["label_agreement"] > 0.95 and r["classes_present"] == 10
    noise = torch.rand(200, 1, 8, 8) * 2 - 1
    assert judge(noise)["confidence"] < r["confidence"] - 0.2


def test_sample_eval_report_commands(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "model.args.ch=8", "train.steps=4", "sample.num=10", "sample.steps=5",
                 "train.progress=false", "eval.every=2", "eval.num_samples=50", "eval.steps=5",
                 "eval.bpd_samples=20", "eval.bpd_timesteps=5"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/fid" in r] == [2, 4] and all("eval/bpd" in r for r in rows if "eval/fid" in r)
    assert main(["sample", "--ckpt", str(run), "--n", "12", "--steps", "5", "--out", str(tmp_path / "s"),
                 "--method", "heun", "--label", "3"]) == 0
    assert (tmp_path / "s" / "grid.png").is_file() and (tmp_path / "s" / "00011.png").is_file()
    assert main(["eval", "--ckpt", str(run), "--n", "30", "--steps", "5", "--no-bpd"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["step"] == 4 and ev["fid"] > 0 and "bpd" not in ev
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4 and "FID" in page or "fid" in page
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "not a fasttrain run directory" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1
