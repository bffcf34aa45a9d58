"""The diffusion loss op (kernels/diffusion_loss.py) on every backend against the PyTorch reference math
(torch_ref.loss, and autograd of it): every prediction type and several weightings, odd shapes,
fp32/bf16/fp16 predictions and data, eps given and regenerated from the stream the noise op drew,
pre-filled bins with non-zero pivots, per-sample upstream gradients, non-finite samples, outputs
independent of history and (native) of the thread count; never zeros as inputs. The reference contract
itself against the prediction types and a loop written out. Inside torch.compile(fullgraph=True) and
DiffusionObjective: test_compile_and_objective.py; on CUDA: test_gpu.py."""
import pytest
import torch
from harness import DTYPES, TOL, assert_same, backends, filled_bins, inputs, tables

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, philox, torch_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise
from fasttrain.kernels.noise_prepare import prepare as prepare_noise

# 2-D toys, odd images, samples over more than one GPU tile and over several 16384-element tiles
SHAPES = [(1, 5), (3, 2), (7, 3, 5, 7), (3, 4, 9, 9), (2, 3000), (2, 40000)]
WEIGHTINGS = ["min_snr", "simple", "speed"]
DRAWN = dict(rtol=1e-4, atol=1e-6)  # eps drawn in the op: to the log/cos rounding of the stream


@backends("torch", "triton", "native")
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_loss_matches_reference(backend, pred, weighting, shape):
    """Loss, per-sample parts, the gradient written in the forward pass and the scatter into bins
    that already hold values, with eps given and with eps drawn in the op (seed, offset)."""
    dev = backend.device
    a, s, w, coef = tables("flow" if pred == "flow" else "cosine", pred, weighting, device=dev)
    x0, eps, t, iw = inputs(shape, device=dev)
    for given in (True, False):
        p = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dev).requires_grad_()
        bins = filled_bins(device=dev)
        before = bins.data.clone()
        kw = dict(eps=eps) if given else dict(seed=5, offset=99)
        mean, per, raw, weighted = diffusion_loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, bins=bins,
                                                  backend=backend.name, **kw)
        e = eps if given else philox.randn(shape, 5, 99, dev)  # the stream the op drew
        rp = p.detach().clone().requires_grad_()
        r_per, r_raw = torch_ref.loss(rp, x0, e, t, w, iw, coef)
        r_per.mean().backward()
        tol = TOL[torch.float32] if given else DRAWN
        torch.testing.assert_close(per, r_per, **tol)
        torch.testing.assert_close(raw, r_raw, **tol)
        torch.testing.assert_close(weighted, w[t] * r_raw, **tol)
        torch.testing.assert_close(mean, r_per.mean(), **tol)
        mean.backward()
        torch.testing.assert_close(p.grad, rp.grad, rtol=tol["rtol"], atol=1e-8)
        expect = TimestepBins(1000, 2, dev)
        expect.pivots = bins.pivots
        expect.scatter_(t, torch.stack([r_raw, w[t] * r_raw]))
        # fp32 losses, fp64 bins
        torch.testing.assert_close(bins.data, before + expect.data, rtol=tol["rtol"], atol=1e-7)


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("pred_dtype", DTYPES)
@pytest.mark.parametrize("x0_dtype", DTYPES)
@pytest.mark.parametrize("pred", ["eps", "v"])
def test_loss_dtypes_with_given_eps(backend, pred_dtype, x0_dtype, pred):
    """fp32 math on the same inputs: the sums to fp32, the gradient to one rounding of pred's dtype;
    with the target's unused term skipped (`uses`) and read."""
    dev = backend.device
    a, s, w, coef = tables("linear", pred, device=dev)
    x0, eps, t, iw = inputs((3, 4, 5, 5), x0_dtype, device=dev)
    for uses in dict.fromkeys([P.get(pred).uses, (True, True)]):
        p = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(2)).to(pred_dtype).to(dev).requires_grad_()
        mean, per, raw, _ = diffusion_loss(p, x0, t, w, iw, coef, uses=uses, eps=eps, backend=backend.name)
        r_per, r_raw, r_grad = torch_ref.loss_and_grad(p.detach(), x0, eps, t, w, iw, coef)
        torch.testing.assert_close(per, r_per, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(raw, r_raw, rtol=1e-5, atol=1e-6)
        mean.backward()
        assert p.grad.dtype == pred_dtype
        torch.testing.assert_close(p.grad, r_grad, **TOL[pred_dtype])


@backends("torch", "triton", "native")
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_loss_regenerates_the_eps_the_noise_op_drew(backend, pred):
    """The noise op draws philox(seed, offset + index); the loss op regenerates the same eps: both
    against the reference computed with that stream."""
    dev = backend.device
    a, s, w, coef = tables("flow" if pred == "flow" else "linear", pred, device=dev)
    x0, _, t, iw = inputs((3, 2, 7, 7), device=dev)
    xt, e = noise(x0, t, a, s, seed=11, offset=12345, return_eps=True, backend=backend.name)
    stream = philox.randn(x0.shape, 11, 12345, dev)
    torch.testing.assert_close(e, stream, rtol=0, atol=1e-5)  # to rounding of log/cos
    assert_same(xt, torch_ref.noise(x0, t, a, s, e), backend)
    p = torch.randn_like(x0).requires_grad_()
    mean, per, _, _ = diffusion_loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=11, offset=12345,
                                     backend=backend.name)
    mean.backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = torch_ref.loss(rp, x0, stream, t, w, iw, coef)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-4, atol=1e-7)


@backends("torch", "triton", "native")
def test_per_sample_upstream_gradient(backend):
    """When the caller rescales each ℓ_b (a learned weighting), the gradient follows per sample."""
    dev = backend.device
    _, _, w, coef = tables("linear", "v", device=dev)
    x0, eps, t, iw = inputs((5, 6), device=dev)
    p = torch.randn(5, 6).to(dev).requires_grad_()
    c = torch.rand(5).to(dev) + 0.5
    _, per, _, _ = diffusion_loss(p, x0, t, w, iw, coef, eps=eps, backend=backend.name)
    (per * c).sum().backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = torch_ref.loss(rp, x0, eps, t, w, iw, coef)
    (r_per * c).sum().backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)


@backends("torch", "triton", "native")
def test_outputs_do_not_depend_on_history(backend):
    """Bit-identical after other calls (another batch size: the Triton kernel resets its workspace) and
    after the allocator handed back memory full of NaN; eps given and drawn."""
    dev = backend.device
    _, _, w, coef = tables("linear", "v", device=dev)
    for shape, given in [((5, 3, 4, 4), True), ((6, 3, 40, 40), False)]:
        x0, eps, t, iw = inputs(shape, device=dev)
        p = torch.randn(shape).to(dev)
        kw = dict(eps=eps) if given else dict(seed=1, offset=3)
        first = diffusion_loss(p, x0, t, w, iw, coef, backend=backend.name, **kw)
        x1, e1, t1, iw1 = inputs((2, 7), seed=4, device=dev)
        diffusion_loss(torch.randn(2, 7).to(dev), x1, t1, w, iw1, coef, eps=e1, backend=backend.name)
        junk = [torch.full_like(p, float("nan")) for _ in range(4)]  # freed: their memory comes back
        del junk
        again = diffusion_loss(p, x0, t, w, iw, coef, backend=backend.name, **kw)
        for u, v in zip(first, again):
            assert torch.equal(u, v)


@backends("native")
def test_native_outputs_do_not_depend_on_the_thread_count(backend):
    """Fixed-order reductions: bit-identical with 1 or 2 threads."""
    _, _, w, coef = tables("linear", "v", device="cpu")
    x0, _, t, iw = inputs((6, 3, 40, 40), device="cpu")
    p = torch.randn(6, 3, 40, 40)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(diffusion_loss(p, x0, t, w, iw, coef, seed=1, offset=3, backend="native"))
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(*runs):
        assert torch.equal(u, v)


@backends("torch", "triton", "native")
def test_non_finite_samples_are_not_scattered(backend):
    dev = backend.device
    _, _, w, coef = tables("linear", "eps", device=dev)
    x0, eps, t, iw = inputs((4, 6), device=dev)
    p = torch.randn(4, 6).to(dev)
    p[1, 2], p[3, 0] = float("nan"), float("inf")
    bins = TimestepBins(1000, 2, dev)
    out = diffusion_loss(p, x0, t, w, iw, coef, eps=eps, bins=bins, backend=backend.name)
    assert not torch.isfinite(out.loss)
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


# -- the reference contract ----------------------------------------------------------------------
def test_targets_are_the_named_predictions():
    """The coefficient tables reproduce eps, x0, v = a·eps - s·x0 and flow = eps - x0 written out."""
    s = fd.schedule("cosine", T=50)
    x0, eps = torch.randn(6, 3), torch.randn(6, 3)
    t = torch.tensor([0, 3, 10, 25, 40, 49])
    a, sg = s.alpha[t, None].float(), s.sigma[t, None].float()
    named = {"eps": eps, "x0": x0, "v": a * eps - sg * x0, "flow": eps - x0}
    for name, expect in named.items():
        got = torch_ref.target(x0, eps, t, P.get(name).table(s.alpha, s.sigma))
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("shape", [(1, 3), (3, 1, 5, 7), (7, 2)])
def test_reference_loss_matches_a_loop(pred, shape):
    s = fd.schedule("cosine", T=50)
    g = torch.Generator().manual_seed(3)
    x0, eps, out = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.randint(0, 50, (shape[0],), generator=g)
    w = fd.loss_weight("min_snr", s, prediction=pred)
    iw = torch.rand(shape[0], generator=g) + 0.5
    per, raw = torch_ref.loss(out, x0, eps, t, w, iw, P.get(pred).table(s.alpha, s.sigma))
    for b in range(shape[0]):
        a, sg = s.alpha[t[b]].item(), s.sigma[t[b]].item()
        tgt = {"eps": eps[b], "x0": x0[b], "v": a * eps[b] - sg * x0[b], "flow": eps[b] - x0[b]}[pred].double()
        mse = ((out[b].double() - tgt) ** 2).mean().item()
        assert raw[b].item() == pytest.approx(mse, rel=1e-5)
        assert per[b].item() == pytest.approx(w[t[b]].item() * iw[b].item() * mse, rel=1e-5)


@backends("torch", "triton", "native")
@pytest.mark.parametrize("pred", ["eps", "v"])
def test_a_spec_without_options_is_the_plain_loss(backend, pred):
    """The loss op on the options' path with no option and the identity row map: the plain op's outputs
    and gradient bit for bit (the same ε regenerated)."""

    dev = backend.device
    _, _, w, coef = tables("linear", pred, device=dev)
    x0, _, t, iw = inputs((3, 2, 7, 7), device=dev)
    spec, _ = prepare_noise(None, x0, seed=4, offset=77, rows=torch.arange(3, device=dev), backend=backend.name)
    outs = []
    for sp in (None, spec):
        p = torch.randn(3, 2, 7, 7, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_()
        out = diffusion_loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=4, offset=77, spec=sp,
                             backend=backend.name)
        out.loss.backward()
        outs.append((*out, p.grad))
    for u, v in zip(*outs):
        assert torch.equal(u, v)
