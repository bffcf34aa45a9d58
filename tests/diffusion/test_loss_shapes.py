"""The loss shape of a run (fasttrain/diffusion/loss_shapes.py): the Huber threshold schedules against
sd-scripts' get_huber_threshold_if_needed and diffusers' scheduled-Huber scripts written out on a
DDPMScheduler's alphas_cumprod; the objective's loss with a shape against the sources' conditional_loss
on the step's own noise; its per-timestep statistics."""
import math

import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.diffusion.loss_shapes import LossShape, huber_threshold
from fasttrain.errors import InvalidInput
from fasttrain.kernels import philox


def ddpm_alphas_cumprod(T=1000):
    """diffusers DDPMScheduler(beta_schedule="linear"): betas linspace(1e-4, 0.02) in float32."""
    betas = torch.linspace(0.0001, 0.02, T, dtype=torch.float32)
    return torch.cumprod(1.0 - betas, dim=0)


def sd_scripts_threshold(schedule, timesteps, huber_c, huber_scale, ac, T=1000):
    """sd-scripts train_util.get_huber_threshold_if_needed (and diffusers', huber_scale = 1)."""
    if schedule == "exponential":
        alpha = -math.log(huber_c) / T
        return torch.exp(-alpha * timesteps) * huber_scale
    if schedule == "snr":
        a = ac.index_select(0, timesteps)
        sigmas = ((1.0 - a) / a) ** 0.5
        return (1 - huber_c) / (1 + sigmas) ** 2 + huber_c
    return torch.full((timesteps.numel(),), huber_c * huber_scale)


@pytest.mark.parametrize("schedule", ["constant", "exponential", "snr"])
@pytest.mark.parametrize("huber_c, huber_scale", [(0.1, 1.0), (0.3, 2.5)])
def test_thresholds_are_the_sources(schedule, huber_c, huber_scale):
    s = fd.schedule("linear", T=1000)
    ac = ddpm_alphas_cumprod()
    torch.testing.assert_close(s.alphas_cumprod.float(), ac, rtol=1e-5, atol=0)
    t = torch.arange(1000)
    want = sd_scripts_threshold(schedule, t, huber_c, huber_scale, ac)
    got = huber_threshold(s, huber_c, huber_scale, schedule)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-5, atol=0)
    if schedule == "exponential":
        assert got[0] == huber_scale and got[-1] == pytest.approx(huber_scale * huber_c ** (999 / 1000))


def test_snr_threshold_at_zero_terminal_snr_is_huber_c():
    s = fd.schedule("linear", T=100, zero_terminal_snr=True)
    c = huber_threshold(s, 0.1, 1.0, "snr")
    assert c[-1] == pytest.approx(0.1) and c[0] > 0.9 and torch.all(c[1:] <= c[:-1])


def test_loss_shape_tables_and_errors():
    s = fd.schedule("cosine", T=50)
    assert LossShape(s, "l2").c_table is None and LossShape(s, "l1").c_table is None
    c = LossShape(s, "pseudo_huber", 0.001, 1.0, "constant").c_table
    assert c.dtype == torch.float32 and torch.all(c == torch.tensor(0.001))
    with pytest.raises(InvalidInput, match="unknown loss 'hub'"):
        LossShape(s, "hub")
    with pytest.raises(InvalidInput, match="huber_c must be a finite number > 0"):
        LossShape(s, "huber", 0.0)


def source_loss(pred, target, kind, c):
    if kind == "huber":
        return 2 * c * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    if kind == "smooth_l1":
        return 2 * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    if kind == "pseudo_huber":
        return torch.sqrt((pred - target) ** 2 + c**2) - c
    return (pred - target).abs()


@pytest.mark.parametrize("kind", ["l1", "huber", "smooth_l1", "pseudo_huber"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_objective_loss_is_the_sources_conditional_loss(kind, backend):
    """ℓ_b = w·iw·mean(ρ) on the step's own noise (the plain stream), and its statistics."""
    s = fd.schedule("linear", T=1000)
    obj = fd.DiffusionObjective(s, "v", "min_snr", "uniform", seed=5, backend=backend,
                                loss=LossShape(s, kind, 0.1, 1.0, "snr"))
    lin = torch.nn.Linear(6, 6)
    x0 = torch.rand(9, 6) * 2 - 1
    offset = int(obj.offset)
    loss, info = obj(lambda x, t: lin(x), x0, generator=torch.Generator().manual_seed(0))
    t = info["t"]
    eps = philox.randn(x0.shape, 5, offset)
    a, sg = s.alpha[t, None].float(), s.sigma[t, None].float()
    pred = lin(a * x0 + sg * eps)
    c = sd_scripts_threshold("snr", t, 0.1, 1.0, ddpm_alphas_cumprod())[:, None]
    raw = source_loss(pred, P.target("v", x0, eps, a, sg), kind, c).mean(1)
    torch.testing.assert_close(info["raw"], raw.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, (obj.weight[t] * raw).mean(), rtol=1e-4, atol=1e-6)
    obj.sync_stats()
    torch.testing.assert_close(obj.stats.means("raw")[t].float(), raw.detach(), rtol=1e-4, atol=1e-6)
