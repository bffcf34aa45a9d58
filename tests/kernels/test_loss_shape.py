"""Loss shapes (kernels/loss_shape.py) in the diffusion loss and the mixed loss ops, on every backend:
the reference ρ against the sources' formulas written out (sd-scripts' and diffusers'
conditional_loss: huber = 2c(√(d²+c²) − c), smooth_l1 = 2(√(d²+c²) − c), l1, l2; diffusers' LCM
pseudo-Huber √(d²+c²) − c) and ψ against autograd; each op against the reference and autograd with a
per-timestep threshold table, odd shapes, fp32/bf16/fp16, pre-filled bins and drawn noise with every
noise option."""
import mixed_harness as mh
import pytest
import torch
from harness import DTYPES, TOL, backends, filled_bins, inputs, tables
from mixed_harness import close, leaf

from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, loss_shape, philox, torch_ref, torch_ref_noise
from fasttrain.kernels import noise_spec as ns
from fasttrain.kernels import torch_ref_mixed_loss as mixed_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.mixed_loss import mixed_loss
from fasttrain.kernels.noise_prepare import prepare as prepare_noise

SHAPED = [k for k in loss_shape.LOSSES if k != "l2"]
DRAWN = dict(rtol=1e-4, atol=1e-6)


def c_table(T=1000, device="cpu", seed=1):
    """A positive per-timestep threshold spanning three decades (as c(t) schedules do)."""
    g = torch.Generator().manual_seed(seed)
    return (10 ** (torch.rand(T, generator=g) * 3 - 2.5)).float().to(device)


def source_loss(pred, target, kind, c):
    """sd-scripts train_util.conditional_loss (reduction "none") and diffusers' LCM pseudo-Huber."""
    if kind == "l2":
        return torch.nn.functional.mse_loss(pred, target, reduction="none")
    if kind == "l1":
        return torch.nn.functional.l1_loss(pred, target, reduction="none")
    if kind == "huber":
        return 2 * c * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    if kind == "smooth_l1":
        return 2 * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    return torch.sqrt((pred - target) ** 2 + c**2) - c


@pytest.mark.parametrize("kind", loss_shape.LOSSES)
def test_rho_is_the_sources_formula_and_psi_its_half_derivative(kind):
    g = torch.Generator().manual_seed(0)
    d = torch.randn(2000, generator=g, dtype=torch.float64) * 3
    c = 10 ** (torch.rand(2000, generator=g, dtype=torch.float64) * 2 - 1.5)
    k = loss_shape.code(kind)
    torch.testing.assert_close(loss_shape.rho(d, c, k), source_loss(d, torch.zeros_like(d), kind, c), rtol=1e-12,
                               atol=1e-14)
    x = d.clone().requires_grad_()
    loss_shape.rho(x, c, k).sum().backward()
    torch.testing.assert_close(loss_shape.psi(d, c, k), x.grad / 2, rtol=1e-12, atol=1e-14)
    # fp32: the cancellation-free form stays accurate where the written-out one loses digits
    small = torch.tensor([1e-4, -3e-5], dtype=torch.float32)
    if k >= loss_shape.HUBER:
        exact = loss_shape.rho(small.double(), torch.tensor(0.1, dtype=torch.float64), k)
        torch.testing.assert_close(loss_shape.rho(small, torch.tensor(0.1), k).double(), exact, rtol=1e-6, atol=0)


@backends("torch", "triton", "native")
@pytest.mark.parametrize("kind", SHAPED)
@pytest.mark.parametrize("pred", ["eps", "v"])
@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (2, 3000), (1, 5)])
def test_loss_op_matches_reference_and_autograd(backend, kind, pred, shape):
    """ℓ_b, raw, weighted, the gradient written in the forward pass (against autograd of the sources'
    formula) and the scatter into pre-filled bins; eps given."""
    dev = backend.device
    _, _, w, coef = tables("cosine", pred, "min_snr", device=dev)
    x0, eps, t, iw = inputs(shape, device=dev)
    c = c_table(device=dev)
    p = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dev).requires_grad_()
    bins = filled_bins(device=dev)
    before = bins.data.clone()
    out = diffusion_loss(p, x0, t, w, iw, coef, eps=eps, loss=kind, c_table=c, bins=bins, backend=backend.name)
    out.loss.backward()
    rp = p.detach().clone().requires_grad_()
    cb = c[t].view(-1, *([1] * (len(shape) - 1)))
    raw = source_loss(rp, torch_ref.target(x0, eps, t, coef), kind, cb).flatten(1).mean(1)
    per = w[t] * iw * raw
    per.mean().backward()
    tol = TOL[torch.float32]
    torch.testing.assert_close(out.raw, raw.detach(), **tol)
    torch.testing.assert_close(out.per_sample, per.detach(), **tol)
    torch.testing.assert_close(out.weighted, (w[t] * raw).detach(), **tol)
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-9)
    expect = TimestepBins(1000, 2, dev)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.stack([raw, w[t] * raw]).detach())
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-5, atol=1e-7)


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", SHAPED)
def test_loss_op_dtypes_and_drawn_noise_with_every_option(backend, dtype, kind):
    """bf16/fp16 predictions and data (fp32 math, the gradient in pred's dtype); eps regenerated with every
    noise option (the loss keeps the unperturbed ε) against the reference on that ε."""
    dev = backend.device
    shape = (3, 2, 9, 7)
    _, _, w, coef = tables("linear", "v", device=dev)
    x0, _, t, iw = inputs(shape, dtype, device=dev)
    c = c_table(device=dev)
    opts = ns.NoiseOptions(offset=0.1, offset_random=True, adaptive_scale=0.3, pyramid_iterations=4,
                           perturbation=0.2)
    spec, _ = prepare_noise(opts, x0, seed=3, offset=55, rows=torch.tensor([1, 2, 0], device=dev), backend=backend.name)
    p = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev).requires_grad_()
    out = diffusion_loss(p, x0, t, w, iw, coef, seed=3, offset=55, spec=spec, loss=kind, c_table=c,
                         backend=backend.name)
    out.loss.backward()
    e = torch_ref_noise.reference_eps(spec, shape, 3, 55, dev)
    r_per, r_raw, r_grad = torch_ref.loss_and_grad(p.detach(), x0, e, t, w, iw, coef, loss_shape.code(kind), c)
    torch.testing.assert_close(out.raw, r_raw, **DRAWN)
    torch.testing.assert_close(out.per_sample, r_per, **DRAWN)
    assert p.grad.dtype == dtype
    torch.testing.assert_close(p.grad, r_grad, **(TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-4,
                                                                                              atol=1e-8)))


@backends("torch", "triton", "native")
def test_l2_with_a_table_is_the_plain_loss(backend):
    """loss="l2" ignores any table and is bit-identical to the default call."""
    dev = backend.device
    _, _, w, coef = tables("linear", "eps", device=dev)
    x0, eps, t, iw = inputs((3, 4, 5, 5), device=dev)
    p = torch.randn(3, 4, 5, 5, device=dev)
    a = diffusion_loss(p, x0, t, w, iw, coef, eps=eps, backend=backend.name)
    b = diffusion_loss(p, x0, t, w, iw, coef, eps=eps, loss="l2", c_table=c_table(device=dev), backend=backend.name)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


# -- mixed prediction: the shape on the x0-space main term and on the heads' aux terms -----------------
def mixed_source(out, x0, eps, t, w, iw, tab, gate, kind, c):
    """torch_ref_mixed_loss's objective with every squared residual replaced by the source's ρ, via autograd."""
    d, e, E, _, aux = mixed_ref.parts(out, x0, eps, t, tab, gate)
    cE = c[t].view(-1, *([1] * (x0.ndim - 1)))
    raw = source_loss(E, torch.zeros_like(E), kind, cE).flatten(1).mean(1)
    own = source_loss(d, torch.zeros_like(d), kind, cE[:, None]).flatten(2).mean(2)
    weighted = w[t] * raw + (aux.flatten(1) * own).sum(1)
    return iw * weighted, raw, weighted, e.pow(2).flatten(2).mean(2)


@backends("torch", "triton", "native")
@pytest.mark.parametrize("kind", SHAPED)
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
@pytest.mark.parametrize("shape", [(3, 2, 5, 7), (5, 3), (2, 3, 17, 19)])
def test_mixed_loss_matches_the_sources_shape_and_autograd(backend, kind, gate, shape):
    dev = backend.device
    heads = ("eps", "x0", "v")
    w, tab = mh.setup(heads, "min_snr", device=dev)
    x0, eps, t, iw, out, g = mh.inputs(shape, 3, gate == "pixel", device=dev)
    c = c_table(device=dev)
    bins = mh.filled_bins(5, device=dev)
    before = bins.data.clone()
    o, gg = leaf(out), leaf(g)
    res = mixed_loss(o, x0, t, w, iw, tab, gate=gg, eps=eps, loss=kind, c_table=c, bins=bins, backend=backend.name)
    res.loss.backward()
    ro, rg = leaf(out), leaf(g)
    per, raw, wl, x0e = mixed_source(ro, x0, eps, t, w, iw, tab, rg, kind, c)
    per.mean().backward()
    tol = TOL[torch.float32]
    for got, want in [(res.per_sample, per), (res.raw, raw), (res.weighted, wl), (res.x0_error, x0e)]:
        torch.testing.assert_close(got, want.detach(), **tol)
    close(o.grad, ro.grad, tol)
    if g is not None:
        close(gg.grad, rg.grad, tol)
    expect = TimestepBins(mh.T, 5, dev)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.cat([raw[None], wl[None], x0e.T]).detach())
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-4, atol=1e-7)


@backends("torch", "triton", "native")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_loss_low_precision_with_noise_options(backend, dtype):
    """bf16/fp16 outputs and data with pseudo-Huber and every noise option (ε regenerated in the op)."""
    dev = backend.device
    heads = ("eps", "x0", "v")
    shape = (3, 2, 9, 7)
    w, tab = mh.setup(heads, "min_snr", device=dev)
    x0, _, t, iw, out, _ = mh.inputs(shape, 3, True, dtype, device=dev)
    c = c_table(device=dev)
    opts = ns.NoiseOptions(offset=0.1, adaptive_scale=0.2, pyramid_iterations=5, perturbation=0.1)
    spec, _ = prepare_noise(opts, x0, seed=2, offset=9, backend=backend.name)
    o = leaf(out)
    res = mixed_loss(o, x0, t, w, iw, tab, seed=2, offset=9, spec=spec, loss="pseudo_huber", c_table=c,
                     backend=backend.name)
    res.loss.backward()
    e = torch_ref_noise.reference_eps(spec, shape, 2, 9, dev)
    per, raw, wl, x0e, grad, _ = mixed_ref.loss_and_grad(out, x0, e, t, w, iw, tab, None, loss_shape.PSEUDO_HUBER, c)
    torch.testing.assert_close(res.raw, raw, **DRAWN)
    torch.testing.assert_close(res.per_sample, per, **DRAWN)
    assert o.grad.dtype == dtype
    close(o.grad, grad, TOL[dtype])


def test_errors_are_one_line():
    _, _, w, coef = tables("linear", "eps", device="cpu")
    x0, eps, t, iw = inputs((2, 3), device="cpu")
    with pytest.raises(ValueError, match="unknown loss shape 'huberish'"):
        diffusion_loss(x0, x0, t, w, iw, coef, eps=eps, loss="huberish", backend="torch")
    with pytest.raises(ValueError, match="needs its threshold table"):
        diffusion_loss(x0, x0, t, w, iw, coef, eps=eps, loss="huber", backend="torch")
    assert philox.check_seed(3) == 3
    assert P.get("eps").uses == (True, False)
