import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P


class Spy(torch.nn.Module):
    """A linear 'model' that records its inputs."""

    def __init__(self, dim):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x, t, y=None):
        self.seen = (x.detach().clone(), t.clone(), y)
        return self.lin(x)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("sampler", ["uniform", "speed", "loss_second_moment"])
def test_objective_matches_hand_computation(pred, sampler):
    s = fd.schedule("flow" if pred == "flow" else "linear", T=1000)
    args = {"dual": False} if sampler == "speed" and pred == "flow" else {}
    obj = fd.DiffusionObjective(s, pred, "min_snr", sampler, sampler_args=args, seed=3)
    model = Spy(5)
    x0 = torch.randn(7, 5)
    offset = int(obj.offset)
    loss, info = obj(model, x0, generator=torch.Generator().manual_seed(0))
    # the noise is the (seed, offset) stream: regenerate it
    obj2 = fd.DiffusionObjective(s, pred, "min_snr", sampler, sampler_args=args, seed=3)
    obj2.offset.fill_(offset)
    eps = obj2.noise(x0)
    t = info["t"]
    a, sg = s.alpha[t, None].float(), s.sigma[t, None].float()
    x_t, tt, _ = model.seen
    torch.testing.assert_close(x_t, a * x0 + sg * eps)
    assert torch.equal(tt, t)
    out = model.lin(x_t)
    raw = ((out - P.target(pred, x0, eps, a, sg)) ** 2).mean(1)
    w = fd.loss_weight("min_snr", s, prediction=pred).float()[t]
    torch.testing.assert_close(info["raw"], raw.detach())
    torch.testing.assert_close(loss, (w * info["iw"] * raw).mean())
    assert obj.offset == offset + x0.numel()
    loss.backward()
    assert model.lin.weight.grad is not None and torch.isfinite(model.lin.weight.grad).all()


def test_noise_stream_is_deterministic_and_advances():
    s = fd.schedule("linear", T=100)
    a, b = fd.DiffusionObjective(s, seed=1), fd.DiffusionObjective(s, seed=1)
    x = torch.zeros(4, 3)
    e1, e2 = a.noise(x), a.noise(x)
    assert torch.equal(e1, b.noise(x)) and not torch.equal(e1, e2)
    assert not torch.equal(e1, fd.DiffusionObjective(s, seed=2).noise(x))  # other seed (other rank)


def test_stats_receive_raw_and_weighted():
    s = fd.schedule("linear", T=1000)
    obj = fd.DiffusionObjective(s, "eps", "min_snr", "uniform")
    model = Spy(4)
    _, info = obj(model, torch.randn(16, 4))
    obj.sync_stats()
    st = obj.stats
    assert st.count.sum().item() == 16
    t0 = info["t"][0]
    assert st.means("weighted")[t0].item() == pytest.approx(
        (info["weighted"][info["t"] == t0]).double().mean().item(), rel=1e-6)


def test_effective_weight_of_unbiased_sampler_ignores_p():
    s = fd.schedule("linear", T=1000)
    obj = fd.DiffusionObjective(s, "v", "min_snr", "loss_second_moment")
    obj.sampler.p = torch.linspace(1, 2, 1000, dtype=torch.float64) / torch.linspace(1, 2, 1000).double().sum()
    torch.testing.assert_close(obj.effective_weight(), torch.clamp(s.snr, max=5.0), rtol=1e-9, atol=0)


def test_bad_backend():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        fd.DiffusionObjective(fd.schedule("linear"), backend="cuda")
