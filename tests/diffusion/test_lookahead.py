"""The shared look-ahead machinery (fasttrain/diffusion/lookahead.py): probes with common random
numbers, the per-element x0-space error, rank splits of a probe grid, the hook's call order."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as PR
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.diffusion.lookahead import LookAhead, Probe, RankSplit, probe_mode, x0_mse
from fasttrain.kernels import philox
from fasttrain.step import reference_step


class Linear(torch.nn.Module):
    def __init__(self, dim, dropout=0.0):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(dim, dim), torch.nn.Dropout(dropout)
        self.calls = []

    def forward(self, x, t, y=None):
        self.calls.append((tuple(x.shape), y is not None))
        return self.drop(self.lin(x))


def test_probe_is_the_philox_stream_and_x0_mse_is_the_hand_computation():
    s = fd.schedule("linear", T=1000)
    obj = fd.DiffusionObjective(s, "v")
    x0, t = torch.randn(10, 6), torch.randint(0, 1000, (10,))
    probe = Probe.draw(obj, x0, t, seed=5, offset=123)
    eps = philox.randn(x0.shape, 5, 123)
    a, sg = s.alpha[t, None].float(), s.sigma[t, None].float()
    torch.testing.assert_close(probe.x_t, a * x0 + sg * eps)
    again = Probe.draw(obj, x0, t, seed=5, offset=123)
    assert torch.equal(again.x_t, probe.x_t)  # the same (seed, offset) is the same ε: CRN
    lin = Linear(6)
    model = Denoiser(lin, PredictionOutput("v", s), s)  # the network with its x̂0 conversion
    mse = x0_mse(model, probe, chunk=3)
    with torch.no_grad():
        x0_hat = PR.to_x0_eps("v", lin.lin(probe.x_t), probe.x_t, a, sg)[0]
    torch.testing.assert_close(mse, (x0 - x0_hat).pow(2).mean(1))
    assert [c[0] for c in lin.calls] == [(3, 6)] * 3 + [(1, 6)]   # one forward per element, chunked
    torch.testing.assert_close(x0_mse(model, probe), mse)       # chunking does not change values


def test_probe_mode_turns_off_active_dropout_only_while_probing():
    s = fd.schedule("linear", T=100)
    obj = fd.DiffusionObjective(s, "eps")
    probe = Probe.draw(obj, torch.randn(4, 8), torch.randint(0, 100, (4,)), seed=0, offset=0)
    model = Denoiser(Linear(8, dropout=0.5), PredictionOutput("eps", s), s).train()
    assert torch.equal(x0_mse(model, probe), x0_mse(model, probe))
    assert model.training
    with probe_mode(model):
        assert not model.training


@pytest.mark.parametrize("n,world", [(16, 2), (1000, 2), (7, 3), (5, 8)])
def test_rank_split_covers_the_grid_once_with_equal_shares(n, world):
    splits = [RankSplit(n, r, world) for r in range(world)]
    assert len({s.per for s in splits}) == 1  # the same number of forwards on every rank
    covered = torch.cat([s.index[s.mask] for s in splits])
    assert torch.equal(covered, torch.arange(n))  # disjoint, contiguous, complete
    vals = [torch.arange(s.per, dtype=torch.float32) + 100 * r for r, s in enumerate(splits)]
    total = sum(s.scatter(v) for s, v in zip(splits, vals))
    expect = torch.cat([v[s.mask] for s, v in zip(splits, vals)])
    assert torch.equal(total, expect)


def test_reference_step_brackets_the_optimizer_step_once_per_step():
    events = []

    class Spy(LookAhead):
        every = 2

        def before_update(self, ctx):
            events.append(("before", ctx.step, ctx.x0.shape[0], float(model.lin.weight.detach().sum())))

        def after_update(self, ctx):
            events.append(("after", ctx.step, ctx.x0.shape[0], float(model.lin.weight.detach().sum())))

    s = fd.schedule("linear", T=100)
    obj = fd.DiffusionObjective(s, "eps")
    model = Linear(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        w0 = float(model.lin.weight.detach().sum())
        micro = [(torch.randn(3, 4), None), (torch.randn(5, 4), None)]  # gradient accumulation
        reference_step(model, obj, opt, micro, step, [Spy(), object()])
        if step % 2 == 0:
            (b, sb, nb, wb), (a, sa, na, wa) = events[-2:]
            assert (b, a, sb, sa, nb, na) == ("before", "after", step, step, 3, 3)  # first micro-batch
            assert wb == w0 and wa != w0  # before sees θ_k after all micro-batches, after sees θ_{k+1}
    assert len(events) == 4
