"""Every weighting against an independent closed form, per prediction type."""
import math

import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd

TS = [0, 10, 50, 100, 130, 200, 500, 700, 999]
LIN = fd.schedule("linear", T=1000)
SNR = [LIN.snr[t].item() for t in TS]
C = {"eps": lambda r: r, "x0": lambda r: 1.0, "v": lambda r: r + 1}  # VP c(t) from SNR


def at(w):
    return [w[t].item() for t in TS]


@pytest.mark.parametrize("pred", ["eps", "x0", "v"])
def test_min_snr_official(pred):
    """TiankaiHang/Min-SNR-Diffusion-Training: eps min(SNR,γ)/SNR, x0 min(SNR,γ), v min(SNR,γ)/(SNR+1)."""
    official = {"eps": lambda r: min(r, 5) / r, "x0": lambda r: min(r, 5), "v": lambda r: min(r, 5) / (r + 1)}
    w = fd.loss_weight("min_snr", LIN, prediction=pred, gamma=5.0)
    assert at(w) == pytest.approx([official[pred](r) for r in SNR], rel=1e-12)


def test_min_snr_numbers_from_the_notes():
    w = fd.loss_weight("min_snr", LIN, prediction="eps", gamma=5.0)
    assert w[0].item() == pytest.approx(0.0005, abs=1e-5)
    assert w[10].item() == pytest.approx(0.011, abs=5e-4)
    assert w[50].item() == pytest.approx(0.155, abs=5e-4)
    assert w[100].item() == pytest.approx(0.586, abs=5e-4)
    assert (w[130:] == 1).all() and (w[:129] < 1).all()
    v = fd.loss_weight("min_snr", LIN, prediction="v", gamma=5.0)
    # v: 5/(SNR+1) rises until SNR = γ, then SNR/(SNR+1) falls: the peak γ/(γ+1) sits at the crossing
    assert int(v.argmax()) == int((LIN.snr >= 5).sum()) and v.max().item() == pytest.approx(5 / 6, abs=2e-3)
    assert v[200].item() == pytest.approx(0.656, abs=1e-3)
    assert v[700].item() == pytest.approx(0.0069, abs=1e-4)


@pytest.mark.parametrize("pred", ["eps", "x0", "v"])
@pytest.mark.parametrize("name,args,x0_form", [
    ("constant", {}, lambda r: 1.0),
    ("snr", {}, lambda r: r),
    ("max_snr", {"gamma": 2.0}, lambda r: max(r, 2.0)),
    ("p2", {"k": 1.0, "gamma": 1.0}, lambda r: r / (1 + r)),
    ("p2", {"k": 2.0, "gamma": 0.5}, lambda r: r / (2 + r) ** 0.5),
    ("edm", {"sigma_data": 0.5}, lambda r: ((1 / r) + 0.25) / ((1 / r) * 0.25)),
])
def test_closed_forms(pred, name, args, x0_form):
    w = fd.loss_weight(name, LIN, prediction=pred, **args)
    assert at(w) == pytest.approx([x0_form(r) / C[pred](r) for r in SNR], rel=1e-10)


def test_soft_min_snr_is_k_diffusion():
    """k-diffusion Denoiser(weighting='soft-min-snr'): F-space weight (σσd)²/(σ²+σd²)², F-MSE =
    x0-MSE / c_out² with c_out² = σ²σd²/(σ²+σd²) (VE sigma σ = SNR^-1/2)."""
    sd = 0.5
    w = fd.loss_weight("soft_min_snr", LIN, prediction="x0", sigma_data=sd)
    for t, r in zip(TS, SNR):
        sig2 = 1 / r
        w_f = sig2 * sd**2 / (sig2 + sd**2) ** 2
        c_out2 = sig2 * sd**2 / (sig2 + sd**2)
        assert w[t].item() == pytest.approx(w_f / c_out2, rel=1e-10)


def test_simple_is_unweighted_mse_of_each_prediction():
    for pred in fd.PREDICTIONS:
        assert (fd.loss_weight("simple", LIN, prediction=pred) == 1).all()


def test_speed_equals_official_table():
    """`weighting="ours"` of NUS-HPC-AI-Lab/SpeeD, recomputed from iDDPM's linear betas with numpy."""
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000))
    g = np.gradient(1 - abar)
    k = 1 - 0.6
    ref = k + (1 - 2 * k) * (g - g.min()) / (g.max() - g.min())
    ref = np.array(ref[:700].tolist() + [1] * 300)
    w = fd.loss_weight("speed", LIN, prediction="eps", lam=0.6, tau=700)
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-9)
    assert w[:700].min().item() == pytest.approx(0.4, abs=0.01) and w[:700].max().item() == pytest.approx(0.6, abs=1e-9)
    assert 200 <= int(w[:700].argmax()) <= 240  # d(1-ᾱ)/dt peaks near t ≈ 219 on linear
    # On other predictions the same objective: eps-weight times SNR/c(t)
    wv = fd.loss_weight("speed", LIN, prediction="v", lam=0.6, tau=700)
    torch.testing.assert_close(wv, w * LIN.snr / (LIN.snr + 1))


def test_flow_weightings():
    f = fd.schedule("flow", T=1000)
    sig = f.sigma
    w = fd.loss_weight("sd3_sigma_sqrt", f, prediction="x0")
    torch.testing.assert_close(w[:-1], sig[:-1] ** -2)
    # on the flow target, sigma^-2 in x0 space is exactly the plain flow-matching MSE
    torch.testing.assert_close(fd.loss_weight("sd3_sigma_sqrt", f, prediction="flow"), torch.ones(1000,
                                                                                                  dtype=torch.float64))
    w = fd.loss_weight("cosmap", f, prediction="x0")
    torch.testing.assert_close(w[:-1], 2 / (math.pi * (1 - 2 * sig[:-1] + 2 * sig[:-1] ** 2)))


@pytest.mark.parametrize("name", [n for n in fd.WEIGHTINGS])
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_zero_snr_guard(name, pred):
    s = fd.schedule("linear", T=1000, zero_terminal_snr=True)
    w = fd.loss_weight(name, s, prediction=pred)
    assert torch.isfinite(w).all()
    assert w[-1].item() == 1.0


# Weightings whose default picks the objective by prediction type (sd-scripts' debiased estimation): fixed here
FIXED = {"debiased": [{"variant": "eps"}, {"variant": "v"}]}
INVARIANT = [(n, a) for n in fd.WEIGHTINGS if n != "simple" for a in FIXED.get(n, [{}])]


@pytest.mark.parametrize("name,args", INVARIANT)
@pytest.mark.parametrize("sched", ["linear", "cosine"])
def test_the_same_model_error_costs_the_same_in_every_prediction_space(name, args, sched):
    """One network error, expressed as an eps, x0 or v output (targets and conversions written out
    here, not taken from the library), must cost the same weighted loss: that is what defining the
    weights in x0 space means. A wrong c(t) in any space breaks it."""
    s = fd.schedule(sched, T=1000)
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0, 20, 130, 400, 700, 990])
    a, sg = s.alpha[t][:, None], s.sigma[t][:, None]
    x0, eps = torch.randn(6, 16, dtype=torch.float64, generator=g), torch.randn(6, 16, dtype=torch.float64, generator=g)
    x_t = a * x0 + sg * eps
    x0_hat = x0 + 0.05 * torch.randn(6, 16, dtype=torch.float64, generator=g)
    eps_hat = (x_t - a * x0_hat) / sg  # the same estimate seen as noise
    outputs = {"x0": (x0_hat, x0), "eps": (eps_hat, eps), "v": (a * eps_hat - sg * x0_hat, a * eps - sg * x0)}
    costs = {p: fd.loss_weight(name, s, prediction=p, **args)[t] * ((out - tgt) ** 2).mean(1)
             for p, (out, tgt) in outputs.items()}
    torch.testing.assert_close(costs["eps"], costs["x0"], rtol=1e-7, atol=0)
    torch.testing.assert_close(costs["v"], costs["x0"], rtol=1e-7, atol=0)
    eff = fd.effective_x0_weight(fd.loss_weight(name, s, prediction="v", **args), s, "v",
                                 torch.full((1000,), 1e-3, dtype=torch.float64))
    torch.testing.assert_close(eff[t] * ((x0_hat - x0) ** 2).mean(1), costs["x0"], rtol=1e-7, atol=0)


def test_learned_logvar_starts_at_fixed_weight_and_learns():
    from fasttrain.diffusion.weighting import uncertainty_loss

    s = fd.schedule("linear", T=100)
    mod = fd.LearnedLogVar(s, channels=16)
    t = torch.tensor([1, 50, 99])
    mse = torch.tensor([0.5, 0.1, 0.01])
    torch.testing.assert_close(uncertainty_loss(mse, mod(t)), mse)  # u = 0 at init
    opt = torch.optim.Adam(mod.parameters(), lr=0.05)
    for _ in range(400):
        opt.zero_grad()
        uncertainty_loss(mse, mod(t)).sum().backward()
        opt.step()
    # the optimum of mse·e^-u + u is u = ln(mse)
    assert mod(t).detach().numpy() == pytest.approx(np.log(mse.numpy()), abs=0.3)


def test_errors():
    with pytest.raises(ValueError, match="unknown weighting 'minsnr'"):
        fd.loss_weight("minsnr", LIN)
    with pytest.raises(ValueError, match="unknown argument 'k'"):
        fd.loss_weight("min_snr", LIN, k=3)
    with pytest.raises(ValueError, match="gamma must be a positive number"):
        fd.loss_weight("min_snr", LIN, gamma=-1)
    with pytest.raises(ValueError, match="lam must lie"):
        fd.loss_weight("speed", LIN, lam=5)  # the official signature default that gives negative weights


def test_edm2_log_variance_layer_is_magnitude_preserving_and_fp32():
    """EDM2's MPConv log-variance (networks_edm2.py): random unit-RMS weight kept at unit RMS by forced
    weight normalization, a unit-norm effective row, u computed in fp32 under autocast."""
    from fasttrain.diffusion.weighting import LearnedLogVar

    s = fd.schedule("linear", T=1000)
    m = LearnedLogVar(s, layer="edm2", seed=3)
    assert [n for n, _ in m.named_parameters()] == ["weight"] and m.weight.shape == (1, 128)
    t = torch.arange(0, 1000, 37)
    u = m(t)
    assert u.shape == t.shape and u.dtype == torch.float32 and u.std() > 0.05  # random at start, not 0
    assert m.weight.pow(2).mean().item() == pytest.approx(1.0, rel=1e-3)  # forced normalization (training)
    with torch.no_grad():
        m.weight.mul_(7.0)
    u2 = m(t)  # the scale of the stored weight does not matter: the row is renormalised
    torch.testing.assert_close(u2, u, rtol=1e-5, atol=1e-6)
    assert m.weight.pow(2).mean().item() == pytest.approx(1.0, rel=1e-3)
    x = torch.cos(m.c_noise[t][:, None] * m.freqs + m.phases) * 2**0.5
    w = m.weight / m.weight.norm()
    torch.testing.assert_close(u, (x @ w.T).squeeze(-1), rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(t).dtype == torch.float32
    assert LearnedLogVar(s)(t).abs().max() == 0  # the linear layer starts at u = 0
