"""The `debiased` weighting against sd-scripts' `apply_debiased_estimation`, rebuilt here from the betas:
the weight tables, and the per-sample loss of a whole objective step for ε and v prediction."""
import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.errors import InvalidInput


def sd_scripts_tables(betas: np.ndarray):
    """ᾱ, and sd-scripts' weights on the ε-MSE and on the v-MSE: 1/sqrt(min(SNR, 1000)), 1/(min(SNR, 1000) + 1),
    with `all_snr = ᾱ/(1 - ᾱ)` (prepare_scheduler_for_custom_training)."""
    abar = np.cumprod(1.0 - betas)
    snr = np.minimum(abar / (1.0 - abar), 1000.0)
    with np.errstate(divide="ignore"):
        return abar, 1.0 / np.sqrt(snr), 1.0 / (snr + 1.0)


BETAS = {"scaled_linear": np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2,  # Stable Diffusion
         "linear": np.linspace(1e-4, 0.02, 1000)}                            # DDPM


@pytest.mark.parametrize("name", list(BETAS))
def test_weight_tables_equal_sd_scripts(name):
    abar, w_eps, w_v = sd_scripts_tables(BETAS[name])
    assert abar[0] / (1 - abar[0]) > 1000 and abar[20] / (1 - abar[20]) < 1000  # the cap binds at the first steps only
    s = fd.schedule(name, T=1000)
    np.testing.assert_allclose(fd.loss_weight("debiased", s, prediction="eps").numpy(), w_eps, rtol=1e-12)
    np.testing.assert_allclose(fd.loss_weight("debiased", s, prediction="v").numpy(), w_v, rtol=1e-12)


class Recorder(torch.nn.Module):
    """A fixed 'network' that records what it saw."""

    def forward(self, x, t):
        self.seen = x.detach().double().clone()
        return 0.6 * x + 0.05


@pytest.mark.parametrize("pred", ["eps", "v"])
def test_objective_loss_equals_sd_scripts(pred):
    """A whole objective step (noise kernel, network, loss kernel) against sd-scripts' quantity built from
    the network's input alone: ε recovered from x_t = sqrt(ᾱ)·x0 + sqrt(1-ᾱ)·ε, the target ε or
    diffusers' `get_velocity` (sqrt(ᾱ)·ε - sqrt(1-ᾱ)·x0), the per-sample MSE, times the source's weight."""
    abar, w_eps, w_v = sd_scripts_tables(BETAS["scaled_linear"])
    obj = fd.DiffusionObjective(fd.schedule("scaled_linear"), pred, "debiased", "uniform", backend="torch", seed=5)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 3, 5, 4, generator=g)
    t = torch.tensor([0, 1, 3, 20, 250, 600, 900, 999])  # t = 0, 1 and 3 sit under the SNR cap
    model = Recorder()
    _, info = obj(model, x0, t=t)
    a, s = (torch.from_numpy(np.sqrt(v[t.numpy()])).view(-1, 1, 1, 1) for v in (abar, 1 - abar))
    x0d = x0.double()
    eps = (model.seen - a * x0d) / s
    target = eps if pred == "eps" else a * eps - s * x0d
    mse = ((0.6 * model.seen + 0.05 - target) ** 2).mean((1, 2, 3))
    expect = mse * torch.from_numpy((w_eps if pred == "eps" else w_v)[t.numpy()])
    torch.testing.assert_close(info["loss_per_sample"].double(), expect, rtol=2e-5, atol=0)


def test_variant_auto_fixed_and_the_zero_snr_guard():
    s = fd.schedule("scaled_linear")
    eps = fd.loss_weight("debiased", s, prediction="eps")
    snr = s.snr
    # "auto" on x0 and flow predictions is the ε objective; a fixed variant converts like every weighting
    torch.testing.assert_close(fd.loss_weight("debiased", s, prediction="x0"), eps * snr, rtol=1e-12, atol=0)
    torch.testing.assert_close(fd.loss_weight("debiased", s, prediction="v", variant="eps"), eps * snr / (snr + 1),
                               rtol=1e-12, atol=0)
    v = fd.loss_weight("debiased", s, prediction="v")
    torch.testing.assert_close(fd.loss_weight("debiased", s, prediction="eps", variant="v"), v * (snr + 1) / snr,
                               rtol=1e-12, atol=0)
    # the v variant is the x0-MSE wherever SNR <= 1000 on a VP schedule
    x0_w = fd.loss_weight("debiased", s, prediction="x0", variant="v")
    assert (x0_w[snr <= 1000] - 1).abs().max() < 1e-12 and (x0_w[snr > 1000] > 1).all()
    # zero-terminal SNR: sd-scripts' ε weight is inf at the last step, fasttrain's guard gives 1; v agrees (1)
    z = fd.schedule("scaled_linear", zero_terminal_snr=True)
    abar = z.alpha.numpy() ** 2
    with np.errstate(divide="ignore"):
        src_eps = 1 / np.sqrt(np.minimum(abar / (1 - abar), 1000))
    assert np.isinf(src_eps[-1])
    we, wv = fd.loss_weight("debiased", z, prediction="eps"), fd.loss_weight("debiased", z, prediction="v")
    assert we[-1].item() == 1.0 and wv[-1].item() == 1.0
    np.testing.assert_allclose(we[:-1].numpy(), src_eps[:-1], rtol=1e-9)


def test_bad_variant_is_one_line():
    with pytest.raises(InvalidInput, match=r"^variant must be one of auto, eps, v, got 'x'$"):
        fd.loss_weight("debiased", fd.schedule("linear"), variant="x")
