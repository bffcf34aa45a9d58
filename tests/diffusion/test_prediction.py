import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P


@pytest.mark.parametrize("sched", ["linear", "cosine", "flow"])
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_conversion_round_trip(sched, pred):
    s = fd.schedule(sched, T=100)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(7, 3, 5, dtype=torch.float64, generator=g)
    eps = torch.randn(7, 3, 5, dtype=torch.float64, generator=g)
    t = torch.tensor([0, 5, 20, 50, 77, 90, 98])
    a, sg = s.alpha[t][:, None, None], s.sigma[t][:, None, None]
    x_t = a * x0 + sg * eps
    x0_hat, eps_hat = P.to_x0_eps(pred, P.target(pred, x0, eps, a, sg), x_t, a, sg)
    torch.testing.assert_close(x0_hat, x0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(eps_hat, eps, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sched", ["linear", "flow"])
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_c_factor_relates_mse(sched, pred):
    """‖pred - target‖² = c(t)·‖x̂0 - x0‖² for a fixed x_t."""
    s = fd.schedule(sched, T=100)
    g = torch.Generator().manual_seed(2)
    t = torch.tensor([3, 30, 60, 90])
    a, sg = s.alpha[t][:, None], s.sigma[t][:, None]
    x0, eps = torch.randn(4, 16, dtype=torch.float64, generator=g), torch.randn(4, 16, dtype=torch.float64, generator=g)
    x_t = a * x0 + sg * eps
    tgt = P.target(pred, x0, eps, a, sg)
    out = tgt + 0.1 * torch.randn(4, 16, dtype=torch.float64, generator=g)
    x0_hat, _ = P.to_x0_eps(pred, out, x_t, a, sg)
    ratio = ((out - tgt) ** 2).sum(1) / ((x0_hat - x0) ** 2).sum(1)
    torch.testing.assert_close(ratio, P.c_factor(pred, s.alpha, s.sigma)[t], rtol=1e-9, atol=0)


def test_c_factor_named_forms():
    s = fd.schedule("linear", T=1000)
    torch.testing.assert_close(P.c_factor("eps", s.alpha, s.sigma), s.snr)
    torch.testing.assert_close(P.c_factor("v", s.alpha, s.sigma), s.snr + 1)
    f = fd.schedule("flow", T=1000)
    torch.testing.assert_close(P.c_factor("flow", f.alpha, f.sigma), f.sigma**-2)


def test_unknown_prediction():
    with pytest.raises(ValueError, match="unknown prediction 'noise'"):
        P.check("noise")
