"""The interference diagnostic on constructed two-bucket problems whose answer can be derived."""
import pytest
import torch

from fasttrain.diffusion.interference import InterferenceDiagnostic
from fasttrain.diffusion.lookahead import LookAheadContext


class Scalar(torch.nn.Module):
    def __init__(self, value=0.0):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor([value]))


class TwoTargets:
    """probe_loss = (θ − target(t))² per sample: target a for the first half of the timesteps, b for
    the second. At θ: g_1 = 2(θ − a), g_2 = 2(θ − b)."""
    T = 100

    def __init__(self, a, b):
        self.a, self.b = a, b

    def probe_loss(self, model, x0, t, eps, cond=None):
        target = torch.where(t < self.T // 2, torch.tensor(self.a), torch.tensor(self.b))
        return (model.theta - target) ** 2


def _measure(a, b, optimizer=None, lr=0.1):
    model = Scalar(0.0)
    diag = InterferenceDiagnostic(TwoTargets.T, every=1, n_buckets=2, probe_size=3)
    ctx = LookAheadContext(model, TwoTargets(a, b), torch.randn(4, 1, 2, 2), None, step=0, lr=lr, optimizer=optimizer)
    diag.after_update(ctx)
    return diag


def test_conflicting_buckets_interfere_and_aligned_ones_help():
    m = _measure(1.0, -1.0).history[-1]["matrix"]  # g = (-2, +2)
    torch.testing.assert_close(m, torch.tensor([[-0.4, 0.4], [0.4, -0.4]], dtype=torch.float64))  # -lr·g_i·g_j
    assert m[0, 1] > 0 and m[1, 0] > 0  # a step for one bucket raises the other's loss
    m = _measure(1.0, 2.0).history[-1]["matrix"]  # g = (-2, -4): both pull θ up
    torch.testing.assert_close(m, torch.tensor([[-0.4, -0.8], [-0.8, -1.6]], dtype=torch.float64))
    h = _measure(1.0, 2.0).history[-1]
    torch.testing.assert_close(h["cosine"], torch.ones(2, 2, dtype=torch.float64))
    torch.testing.assert_close(h["grad_norms"], torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_the_optimizers_preconditioner_scales_the_step():
    model = Scalar(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.theta.grad = torch.tensor([4.0])
    opt.step()  # v = (1 - β2)·16 after one step; v̂ = 16
    model.theta.data.zero_()
    diag = InterferenceDiagnostic(TwoTargets.T, every=1, n_buckets=2, probe_size=3)
    ctx = LookAheadContext(model, TwoTargets(1.0, -1.0), torch.randn(4, 1, 2, 2), None, step=0, lr=0.1, optimizer=opt)
    diag.after_update(ctx)
    p = 1 / (4.0 + 1e-8)
    torch.testing.assert_close(diag.history[-1]["matrix"][0, 1], torch.tensor(0.1 * 4 * p, dtype=torch.float64))
    assert model.theta.grad is None and model.theta.item() == 0.0  # weights and gradients left as they were


def test_state_round_trip_and_metrics():
    d = _measure(1.0, -1.0)
    m = d.metrics()
    assert m["interference/offdiag_mean"] == pytest.approx(0.4) and m["interference/diag_mean"] == pytest.approx(-0.4)
    e = InterferenceDiagnostic(TwoTargets.T, every=1, n_buckets=2, probe_size=3)
    e.load_state_dict(d.state_dict())
    assert torch.equal(e.history[-1]["matrix"], d.history[-1]["matrix"]) and e.probe["P"] == 3
