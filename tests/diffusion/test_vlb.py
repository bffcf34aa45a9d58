"""Single-step VLB tables (fasttrain/diffusion/vlb.py) against an independent computation: the Gaussian
KL of torch.distributions between the DDPM posterior and the model, built from the betas as in
improved-diffusion / ddpm-torch (`q_posterior_mean_var`, fixed-small / fixed-large variances)."""
import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from fasttrain import diffusion as fd
from fasttrain.diffusion.denoiser import PredictionOutput
from fasttrain.diffusion.vlb import valid_steps, vlb_tables


def ddpm_terms(s, t, x0, x0_hat, x_t, variance):
    """KL per dimension in bits from the betas (Ho et al. 2020, Eq. 6-7), for VP schedules."""
    abar = s.alpha.double() ** 2
    abar_prev = abar[t - 1]
    beta = 1 - abar[t] / abar_prev
    post_var = beta * (1 - abar_prev) / (1 - abar[t])
    c1 = beta * abar_prev.sqrt() / (1 - abar[t])
    c2 = (1 - beta).sqrt() * (1 - abar_prev) / (1 - abar[t])
    q = Normal(c1 * x0 + c2 * x_t, post_var.sqrt())
    model_var = beta if variance == "large" else post_var
    p = Normal(c1 * x0_hat + c2 * x_t, model_var.sqrt())
    return kl_divergence(q, p).mean() / math.log(2)


@pytest.mark.parametrize("variance", ["large", "small"])
@pytest.mark.parametrize("name", ["linear", "cosine", "quad"])
def test_vlb_terms_match_the_gaussian_kl(name, variance):
    s = fd.schedule(name, T=1000)
    coef, const = vlb_tables(s, variance)
    g = torch.Generator().manual_seed(0)
    for t in [1, 2, 17, 500, 999]:
        x0 = torch.randn(64, generator=g, dtype=torch.float64)
        x0_hat = x0 + 0.1 * torch.randn(64, generator=g, dtype=torch.float64)
        x_t = s.alpha[t] * x0 + s.sigma[t] * torch.randn(64, generator=g, dtype=torch.float64)
        ref = ddpm_terms(s, t, x0, x0_hat, x_t, variance)
        mine = coef[t] * (x0 - x0_hat).pow(2).mean() + const[t]
        torch.testing.assert_close(mine, ref, rtol=1e-7, atol=1e-12)
    if variance == "small":
        snr = s.snr
        torch.testing.assert_close(coef[1:], 0.5 * (snr[:-1] - snr[1:]) / math.log(2))
        assert torch.all(const[1:].abs() < 1e-12)


def test_decoder_term_is_the_gaussian_decoder_nll():
    s = fd.schedule("linear", T=1000)
    coef, const = vlb_tables(s)
    x0, x0_hat = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    nll = -Normal(x0_hat, (1 / s.snr[0]).sqrt()).log_prob(x0).mean() / math.log(2)
    torch.testing.assert_close(coef[0] * (x0 - x0_hat).pow(2).mean() + const[0], nll)


def test_flow_and_zero_terminal_schedules_are_finite_and_mark_undefined_steps():
    for s in [fd.schedule("flow", T=100), fd.schedule("linear", T=100, zero_terminal_snr=True)]:
        coef, const = vlb_tables(s)
        assert torch.isfinite(coef).all() and torch.isfinite(const).all() and (coef >= 0).all()
        valid = valid_steps(s, PredictionOutput("eps", s).x0_defined())
        assert not valid[-1] and valid[:-1].all()  # eps cannot give x0 where alpha = 0
        assert valid_steps(s, PredictionOutput("v", s).x0_defined()).all()
