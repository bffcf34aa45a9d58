"""Generation solvers driven by the exact denoiser of a 2-D Gaussian mixture reproduce the mixture."""
import pytest
import torch
from gmm_oracle import OracleModel, moments

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.diffusion.solvers import SOLVERS, edm_timesteps, generate, respaced

CASES = [("ddpm", "linear", "eps", 200), ("ddim", "linear", "v", 50), ("ddim", "cosine", "x0", 50),
         ("heun", "linear", "eps", 30), ("heun", "cosine", "v", 30), ("flow_euler", "flow", "flow", 100),
         ("flow_heun", "flow", "flow", 30), ("ddim", "flow", "v", 50), ("heun", "flow", "flow", 30)]


def denoiser(model, schedule, pred, error: float = 0.0, seed: int = 5):
    """(x̂0, ε̂) from a model's output, optionally with a small relative error in that output."""
    g = torch.Generator().manual_seed(seed)

    def denoise(x, t):
        tt = torch.full((x.shape[0],), t, dtype=torch.long)
        out = model(x, tt)
        if error:
            out = out + error * out.abs().mean() * torch.randn(out.shape, generator=g)
        a, s = schedule.alpha[t].float(), schedule.sigma[t].float()
        return P.to_x0_eps(pred, out, x, a, s)

    return denoise


def check_mixture(x):
    mean, cov = moments()
    x = x.double()
    assert torch.isfinite(x).all()
    torch.testing.assert_close(x.mean(0), mean, atol=0.05, rtol=0)  # 4000 samples: SE of a mean ≈ 0.015
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.06, rtol=0.08)
    assert (x[:, 0] < 0).double().mean().item() == pytest.approx(0.3, abs=0.04)  # component weights 0.3 / 0.7


@pytest.mark.parametrize("solver,sched,pred,steps", CASES)
def test_solver_reproduces_the_mixture(solver, sched, pred, steps):
    s = fd.schedule(sched, T=1000)
    x = generate(denoiser(OracleModel(s, pred), s, pred), s, (4000, 2), solver=solver, steps=steps,
                 generator=torch.Generator().manual_seed(0))
    check_mixture(x)


@pytest.mark.parametrize("sched,zt,pred", [("linear", True, "v"), ("cosine", True, "v"), ("flow", False, "flow"),
                                           ("flow", False, "x0")])
def test_snr_zero_schedules_tolerate_model_error(sched, zt, pred):
    """With SNR = 0 at the last step, the supported predictions stay stable when the model is
    slightly wrong (an exact oracle would hide an ill-conditioned x̂0)."""
    s = fd.schedule(sched, T=1000, zero_terminal_snr=zt)
    x = generate(denoiser(OracleModel(s, pred), s, pred, error=0.02), s, (4000, 2), solver="ddim", steps=50,
                 generator=torch.Generator().manual_seed(1))
    assert x.std(0).max() < 2.0  # the data std is below 1.1; a blow-up gives 50-1000
    check_mixture(x)


def test_eps_prediction_is_refused_where_alpha_is_zero():
    """x̂0 = (x - σ·ε̂)/α at α = 0: the bundle and the config refuse the combination."""
    from fasttrain.configure import load_config
    from fasttrain.errors import ConfigError

    for over in (["diffusion.schedule=flow"], ["diffusion.zero_terminal_snr=true"]):
        with pytest.raises(ConfigError, match="'diffusion.prediction'.*cannot be sampled"):
            load_config("default", over)
    assert (P.conditioning("eps", fd.schedule("flow")) == 0).any()
    assert (P.conditioning("eps", fd.schedule("cosine")) > 1e-6).all()  # iDDPM's cosine stays usable


def test_ddim_eta0_is_deterministic_and_ddpm_is_not():
    s = fd.schedule("linear", T=1000)
    d = denoiser(OracleModel(s, "eps"), s, "eps")
    run = lambda solver, seed: generate(d, s, (64, 2), solver=solver, steps=20,
                                        generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run("ddim", 3), run("ddim", 3))
    assert not torch.equal(run("ddim", 3), run("ddim", 4))
    assert not torch.allclose(run("ddpm", 3), run("ddim", 3))  # the same start, DDPM's extra noise


def test_spacings_and_errors():
    assert respaced(1000, 4) == [999, 666, 333, 0]
    assert respaced(10, 10) == list(range(9, -1, -1))
    with pytest.raises(ValueError, match="steps must lie"):
        respaced(10, 11)
    with pytest.raises(ValueError, match="unknown step spacing"):
        respaced(10, 2, "middle")
    s = fd.schedule("linear", T=1000)
    ts = edm_timesteps(s, 18)
    assert ts == sorted(set(ts), reverse=True) and ts[-1] == 0
    # each EDM sigma lands on the nearest timestep in log sigma_e
    se = torch.log(s.edm_sigma())
    for t in ts[1:-1]:
        assert se[t - 1] < se[t] < se[t + 1]
    d = denoiser(OracleModel(s, "eps"), s, "eps")
    with pytest.raises(ValueError, match="needs the flow schedule"):
        generate(d, s, (2, 2), solver="flow_euler")
    with pytest.raises(ValueError, match="unknown solver 'euler'"):
        generate(d, s, (2, 2), solver="euler")
    with pytest.raises(ValueError, match="unknown argument 'eta'"):
        generate(d, s, (2, 2), solver="heun", eta=0.5)
    assert {"ddim", "ddpm", "heun", "flow_euler", "flow_heun"} <= set(SOLVERS)


@pytest.mark.parametrize("kind", ["trailing", "leading"])
def test_spacings_are_the_lists_diffusers_schedulers_visit(kind):
    """sample.spacing names diffusers' timestep_spacing: the same timesteps, and where n divides T the
    same steps as DDIMScheduler's t → t − T//n (so a stock pipeline can equal fasttrain's sampler)."""
    diffusers = pytest.importorskip("diffusers")
    for T, n in ((1000, 4), (1000, 50), (1000, 7), (1000, 1000), (20, 3)):
        for cls in (diffusers.DDIMScheduler, diffusers.DDPMScheduler, diffusers.EulerDiscreteScheduler):
            sched = cls(num_train_timesteps=T, timestep_spacing=kind)
            sched.set_timesteps(n)
            assert respaced(T, n, kind) == sched.timesteps.round().long().tolist(), (T, n, cls.__name__)
        ts = respaced(T, n, kind)
        if T % n == 0:
            assert all(a - b == T // n for a, b in zip(ts, ts[1:]))
    assert respaced(1000, 4, "linspace") == respaced(1000, 4)  # the spacing of runs before format 4


def test_noise_is_drawn_as_randn_tensor_draws_it():
    pytest.importorskip("diffusers")
    from diffusers.utils.torch_utils import randn_tensor

    from fasttrain.diffusion.solvers import randn

    want = randn_tensor((3, 2, 4), generator=torch.Generator().manual_seed(7), device=torch.device("cpu"))
    torch.testing.assert_close(randn((3, 2, 4), torch.Generator().manual_seed(7), "cpu"), want, rtol=0, atol=0)
