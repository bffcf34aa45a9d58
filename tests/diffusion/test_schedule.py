import math

import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd


@pytest.mark.parametrize("name", ["linear", "scaled_linear", "cosine", "quad"])
def test_vp_tables(name):
    s = fd.schedule(name, T=1000)
    assert s.alpha.dtype == s.sigma.dtype == s.snr.dtype == torch.float64
    assert s.alpha.shape == (1000,)
    torch.testing.assert_close(s.alpha**2 + s.sigma**2, torch.ones(1000, dtype=torch.float64))
    assert (s.snr[1:] < s.snr[:-1]).all(), "SNR must fall with t"


def test_linear_matches_iddpm_betas():
    T = 1000
    betas = np.linspace(1e-4, 0.02, T)
    abar = np.cumprod(1 - betas)
    s = fd.schedule("linear", T=T)
    np.testing.assert_allclose(s.alphas_cumprod.numpy(), abar, rtol=1e-12)
    # iDDPM scales the end points by 1000/T for other T
    s2 = fd.schedule("linear", T=500)
    np.testing.assert_allclose(s2.alphas_cumprod.numpy(), np.cumprod(1 - np.linspace(2e-4, 0.04, 500)), rtol=1e-12)


def test_cosine_closed_form():
    T = 1000
    s = fd.schedule("cosine", T=T)
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
    for t in (0, 100, 500, 900):  # betas are not clipped here, so ᾱ_t = f((t+1)/T)/f(0)
        assert s.alphas_cumprod[t].item() == pytest.approx(f((t + 1) / T) / f(0), rel=1e-10)


def test_scaled_linear_and_quad_betas():
    s = fd.schedule("scaled_linear", T=1000)
    b = np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2
    np.testing.assert_allclose(s.alphas_cumprod.numpy(), np.cumprod(1 - b), rtol=1e-12)
    q = fd.schedule("quad", T=1000)
    b = np.linspace(1e-2, 0.02**0.5, 1000) ** 2
    np.testing.assert_allclose(q.alphas_cumprod.numpy(), np.cumprod(1 - b), rtol=1e-12)


@pytest.mark.parametrize("name", ["linear", "cosine", "scaled_linear"])
def test_zero_terminal_snr(name):
    base = fd.schedule(name, T=1000)
    s = fd.schedule(name, T=1000, zero_terminal_snr=True)
    assert s.snr[-1].item() == 0.0 and s.sigma[-1].item() == 1.0
    assert s.alpha[0].item() == pytest.approx(base.alpha[0].item(), rel=1e-12)
    assert (s.snr[:-1] > 0).all()


def test_flow_grid():
    s = fd.schedule("flow", T=10)
    grid = torch.arange(1, 11, dtype=torch.float64) / 10
    torch.testing.assert_close(s.sigma, grid)
    torch.testing.assert_close(s.alpha, 1 - grid)
    assert s.snr[-1].item() == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="unknown schedule 'foo'"):
        fd.schedule("foo")
    with pytest.raises(ValueError, match="T must be"):
        fd.schedule("linear", T=1)
