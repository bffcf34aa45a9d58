"""The per-timestep statistics bins (kernels/bins.py) against direct computations. What the loss ops
scatter into them: test_diffusion_loss.py, test_mixed_loss.py."""
import pytest
import torch

from fasttrain.kernels import TimestepBins


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
