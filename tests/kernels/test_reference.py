"""The reference contracts, the noise stream and the statistics bins against direct computations."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, philox, reference as ref


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("shape", [(1, 3), (3, 1, 5, 7), (7, 2)])
def test_loss_matches_loop(pred, shape):
    s = fd.schedule("cosine", T=50)
    g = torch.Generator().manual_seed(3)
    x0, eps, out = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.randint(0, 50, (shape[0],), generator=g)
    w = fd.loss_weight("min_snr", s, prediction=pred)
    iw = torch.rand(shape[0], generator=g) + 0.5
    per, raw = ref.loss(out, x0, eps, t, w, iw, P.get(pred).table(s.alpha, s.sigma))
    for b in range(shape[0]):
        a, sg = s.alpha[t[b]].item(), s.sigma[t[b]].item()
        tgt = {"eps": eps[b], "x0": x0[b], "v": a * eps[b] - sg * x0[b], "flow": eps[b] - x0[b]}[pred].double()
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


def _philox_scalar(seed, counter):
    """Philox4x32-10 written out on Python ints (Salmon et al. 2011, Fig. 2)."""
    M = 0xFFFFFFFF
    c = [counter & M, (counter >> 32) & M, 0, 0]
    k = [seed & M, (seed >> 32) & M]
    for _ in range(10):
        pa, pb = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(pb >> 32) ^ c[1] ^ k[0], pb & M, (pa >> 32) ^ c[3] ^ k[1], pa & M]
        k = [(k[0] + 0x9E3779B9) & M, (k[1] + 0xBB67AE85) & M]
    return c


@pytest.mark.parametrize("seed,offset", [(0, 0), (7, 2**32 - 3), (2**40 + 9, 2**33), (2**63 - 1, 5)])
def test_philox_words_against_python_ints(seed, offset):
    idx = torch.arange(6) + offset
    words = philox.philox4x32(seed, idx)
    for i, ctr in enumerate(idx.tolist()):
        assert [w[i].item() for w in words] == _philox_scalar(seed, ctr)


def test_philox_uses_the_full_seed_and_offset_width():
    """Seeds s and s + 2**32 (and offsets o and o + 2**32) give different noise."""
    a = philox.randn((1000,), 5, 0)
    assert (a - philox.randn((1000,), 5 + 2**32, 0)).abs().mean() > 0.5
    assert (a - philox.randn((1000,), 5, 2**32)).abs().mean() > 0.5
    assert abs(a.mean().item()) < 0.1 and abs(a.std().item() - 1) < 0.1
    with pytest.raises(ValueError, match="seed must lie in"):
        philox.randn((3,), -1, 0)


def test_bins_scatter_and_moments_against_a_loop():
    T = 6
    t = torch.tensor([2, 0, 2, 2, 4])
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.5, 0.25, 1.5, 2.0, 3.0]])
    b = TimestepBins(T, 2)
    b.set_pivots(torch.tensor([[0.0, 0, 1.5, 0, 0, 0], [0, 0, 9.0, 0, 0, 0]]))
    b.scatter_(t, v)
    assert b.data.dtype == torch.float64 and b.data.shape == (5, T)
    assert b.data[0].tolist() == [1, 0, 3, 0, 1, 0]
    assert b.data[1, 2].item() == pytest.approx((1 - 1.5) + (3 - 1.5) + (4 - 1.5))  # shifted by the pivot
    n, mean, m2 = b.moments()
    assert mean[0, 2].item() == pytest.approx(8 / 3) and mean[1, 2].item() == pytest.approx(4 / 3)
    vals = torch.tensor([1.0, 3.0, 4.0], dtype=torch.float64)
    assert m2[0, 2].item() == pytest.approx(((vals - vals.mean()) ** 2).sum().item())
    assert mean[0, 1].item() == 0 and n[1].item() == 0


def test_bins_leave_out_non_finite_samples():
    b = TimestepBins(3, 2)
    b.scatter_(torch.tensor([0, 1, 1]), torch.tensor([[1.0, float("nan"), 2.0], [1.0, 1.0, float("inf")]]))
    assert b.data[0].tolist() == [1, 0, 0] and torch.isfinite(b.data).all()
