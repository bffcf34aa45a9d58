"""The reference contracts against direct per-sample loops."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import reference as ref


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("shape", [(1, 3), (3, 1, 5, 7), (7, 2)])
def test_loss_matches_loop(pred, shape):
    s = fd.schedule("cosine", T=50)
    g = torch.Generator().manual_seed(3)
    x0, eps, out = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.randint(0, 50, (shape[0],), generator=g)
    w = fd.loss_weight("min_snr", s, prediction=pred)
    iw = torch.rand(shape[0], generator=g) + 0.5
    per, raw = ref.loss(out, x0, eps, t, s.alpha, s.sigma, w, iw, pred)
    for b in range(shape[0]):
        a, sg = s.alpha[t[b]].item(), s.sigma[t[b]].item()
        tgt = P.target(pred, x0[b].double(), eps[b].double(), a, sg)
        mse = ((out[b].double() - tgt) ** 2).mean().item()
        assert raw[b].item() == pytest.approx(mse, rel=1e-5)
        assert per[b].item() == pytest.approx(w[t[b]].item() * iw[b].item() * mse, rel=1e-5)


def test_noise_and_dtype():
    s = fd.schedule("linear", T=100)
    x0 = torch.randn(3, 4).bfloat16()
    eps = torch.randn(3, 4)
    t = torch.tensor([0, 50, 99])
    x_t = ref.noise(x0, t, s.alpha, s.sigma, eps)
    assert x_t.dtype == torch.bfloat16
    expect = s.alpha[t, None].float() * x0.float() + s.sigma[t, None].float() * eps
    torch.testing.assert_close(x_t.float(), expect, atol=2e-2, rtol=1e-2)


def test_scatter_stats_matches_loop():
    t = torch.tensor([2, 0, 2, 2, 4])
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.5, 0.25, 1.5, 2.0, 3.0]])
    bins = ref.scatter_stats(t, v, 6)
    assert bins.dtype == torch.float64 and bins.shape == (5, 6)
    assert bins[0].tolist() == [1, 0, 3, 0, 1, 0]
    assert bins[1].tolist() == [2, 0, 8, 0, 5, 0]
    assert bins[2].tolist() == [4, 0, 26, 0, 25, 0]
    assert bins[3, 2].item() == 4.0 and bins[4, 2].item() == pytest.approx(0.25 + 2.25 + 4.0)
