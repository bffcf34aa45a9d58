"""Bits/dim against analytic values, the discretized decoder, and improved-diffusion's convention."""
import math

import numpy as np
import pytest
import torch
from gmm_oracle import log_density, x0_posterior_mean
from gmm_oracle import sample as gmm_sample

from fasttrain import diffusion as fd
from fasttrain.diffusion.nelbo import decoder_variance, log_discretized_gaussian, nelbo_bits_per_dim
from fasttrain.diffusion.schedule import NoiseSchedule


def logsnr_schedule(T, hi=10.0, lo=-10.0):
    """Steps uniform in log-SNR: the discrete-time bound approaches the continuous one as T grows."""
    lam = torch.linspace(hi, lo, T, dtype=torch.float64)
    return NoiseSchedule("logsnr", torch.sigmoid(lam).sqrt(), torch.sigmoid(-lam).sqrt())


def gauss_x0_hat(s, v):
    """The exact E[x0 | x_t] for data N(0, v·I)."""
    def fn(x, t, y=None):
        a, sg = s.alpha[t][:, None], s.sigma[t][:, None]
        return a * v / (a * a * v + sg * sg) * x.double()
    return fn


def mixture_x0_hat(s):
    def fn(x, t, y=None):
        return x0_posterior_mean(x, s.alpha[t], s.sigma[t])
    return fn


def test_bpd_of_gaussian_data_matches_the_analytic_bound_and_entropy():
    v, T = 0.3, 2000
    s = logsnr_schedule(T)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2, generator=g, dtype=torch.float64) * math.sqrt(v)
    r = nelbo_bits_per_dim(gauss_x0_hat(s, v), s, x, n_t=400, discrete=False, generator=g)
    snr = s.snr
    mmse = v / (1 + v * snr)  # E‖x0 - E[x0|x_i]‖² per dimension
    exact_diffusion = (0.5 * (snr[:-1] - snr[1:]) * mmse[1:]).sum().item() / math.log(2)
    assert r["diffusion"] == pytest.approx(exact_diffusion, rel=0.01)
    entropy = 0.5 * math.log(2 * math.pi * math.e * v) / math.log(2)
    assert entropy - 0.01 < r["bpd"] < entropy + 0.04  # a bound, tight up to the time discretisation
    assert 0 < r["bpd_se"] < 0.05


def test_bpd_of_the_exact_mixture_denoiser_is_close_to_the_true_nll():
    g = torch.Generator().manual_seed(1)
    x = gmm_sample(1500, g)
    nll = -log_density(x).mean().item() / (2 * math.log(2))
    gaps = []
    for T in (500, 2000):
        s = logsnr_schedule(T)
        r = nelbo_bits_per_dim(mixture_x0_hat(s), s, x, n_t=200, discrete=False, generator=g)
        gaps.append(r["bpd"] - nll)
    assert -0.02 < gaps[1] < 0.1, gaps
    assert gaps[1] < gaps[0]  # finer time steps tighten the bound


def test_discretized_gaussian_is_a_distribution_over_256_levels():
    centres = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in ((0.1, -2.0), (-0.95, -4.0), (0.999, -1.0)):
        lp = log_discretized_gaussian(centres, torch.full_like(centres, mean), torch.full_like(centres, log_scale))
        assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-9)


def _iddpm_decoder_bits(x0, x0_hat_0, betas):
    """improved-diffusion's decoder term (`_vb_terms_bpd` at t = 0), written out from its formulas:
    mean = posterior mean at t = 0 (= x̂0), log variance = posterior_log_variance_clipped[0]
    (= log posterior_variance[1]), discretized Gaussian with its tanh approximation of the CDF."""
    ac = np.cumprod(1 - betas)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = betas * (1 - ac_prev) / (1 - ac)
    log_var0 = np.log(post_var[1])

    def cdf(z):
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))

    inv = math.exp(-0.5 * log_var0)
    plus, minus = cdf(inv * (x0 - x0_hat_0 + 1 / 255)), cdf(inv * (x0 - x0_hat_0 - 1 / 255))
    lp = torch.where(x0 < -0.999, torch.log(plus.clamp(min=1e-12)),
                     torch.where(x0 > 0.999, torch.log((1 - minus).clamp(min=1e-12)),
                                 torch.log((plus - minus).clamp(min=1e-12))))
    return (-lp).flatten(1).sum(1).mean().item() / (x0[0].numel() * math.log(2))


def test_decoder_follows_improved_diffusion():
    s = fd.schedule("linear", T=1000)
    betas = np.linspace(1e-4, 0.02, 1000)
    want = betas[1] * (1 - (1 - betas[0])) / (1 - (1 - betas[0]) * (1 - betas[1]))
    assert decoder_variance(s).item() == pytest.approx(want, rel=1e-9)
    g = torch.Generator().manual_seed(3)
    x0 = torch.round((torch.rand(64, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1) * 127.5) / 127.5
    bias = 0.003 * torch.randn(64, 1, 8, 8, generator=g, dtype=torch.float64)

    def x0_hat(x, t, y=None):  # an imperfect model: its estimate at t = 0 is off by `bias`
        a, sg = s.alpha[t].view(-1, 1, 1, 1), s.sigma[t].view(-1, 1, 1, 1)
        return x0 + bias if (t == 0).all() else (x.double() - sg * 0) / a

    r = nelbo_bits_per_dim(x0_hat, s, x0, n_t=4, discrete=True, generator=g)
    assert r["decoder"] == pytest.approx(_iddpm_decoder_bits(x0, x0 + bias, betas), abs=2e-3)
