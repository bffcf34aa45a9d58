"""Samplers driven by the exact denoiser of a 2-D Gaussian mixture reproduce the mixture."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.sample import respaced, sample

from gmm_oracle import OracleModel, moments

CASES = [("ddpm", "linear", "eps", 200), ("ddim", "linear", "v", 50), ("ddim", "cosine", "x0", 50),
         ("heun", "linear", "eps", 30), ("heun", "cosine", "v", 30), ("flow_euler", "flow", "flow", 100),
         ("flow_heun", "flow", "flow", 30), ("ddim", "flow", "eps", 50), ("heun", "flow", "flow", 30)]


@pytest.mark.parametrize("method,sched,pred,steps", CASES)
def test_sampler_reproduces_the_mixture(method, sched, pred, steps):
    s = fd.schedule(sched, T=1000)
    x = sample(OracleModel(s, pred), s, pred, (4000, 2), steps=steps, method=method, clip_x0=None,
               generator=torch.Generator().manual_seed(0))
    mean, cov = moments()
    x = x.double()
    assert torch.isfinite(x).all()
    torch.testing.assert_close(x.mean(0), mean, atol=0.05, rtol=0)  # 4000 samples: SE of a mean ≈ 0.015
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.06, rtol=0.08)
    share_left = (x[:, 0] < 0).double().mean().item()  # component weights 0.3 / 0.7
    assert share_left == pytest.approx(0.3, abs=0.04)


def test_ddim_eta0_is_deterministic_and_ddpm_is_not():
    s = fd.schedule("linear", T=1000)
    m = OracleModel(s, "eps")
    run = lambda method, seed: sample(m, s, "eps", (64, 2), steps=20, method=method, clip_x0=None,  # noqa: E731
                                      generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run("ddim", 3), run("ddim", 3))
    assert not torch.equal(run("ddim", 3), run("ddim", 4))
    # with the same start, DDPM's extra noise makes it differ from DDIM
    assert not torch.allclose(run("ddpm", 3), run("ddim", 3))


def test_guidance_mixes_conditional_and_unconditional():
    s = fd.schedule("linear", T=100)

    class Model(torch.nn.Module):
        def forward(self, x, t, y):
            return torch.where((y == 2)[:, None], torch.ones_like(x), torch.zeros_like(x))

    labels = torch.zeros(4, dtype=torch.long)
    seen = {}
    for g in (1.0, 3.0):
        seen[g] = sample(Model(), s, "x0", (4, 2), steps=1, labels=labels, guidance=g, null_label=2, clip_x0=None)
    # x0-pred: cond 0, uncond 1 → guided output 1 + g·(0 - 1)
    torch.testing.assert_close(seen[1.0], torch.zeros(4, 2))
    torch.testing.assert_close(seen[3.0], torch.full((4, 2), -2.0))


def test_respacing_and_errors():
    assert respaced(1000, 4) == [999, 666, 333, 0]
    assert respaced(10, 10) == list(range(9, -1, -1))
    with pytest.raises(ValueError, match="steps must lie"):
        respaced(10, 11)
    s = fd.schedule("linear", T=100)
    with pytest.raises(ValueError, match="needs the flow schedule"):
        sample(OracleModel(s, "eps"), s, "eps", (2, 2), method="flow_euler")
    with pytest.raises(ValueError, match="unknown sampling method"):
        sample(OracleModel(s, "eps"), s, "eps", (2, 2), method="euler")
