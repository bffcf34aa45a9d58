"""The Triton kernels (run by the interpreter on CPU, compiled on CUDA) against the PyTorch reference:
every prediction type, several weightings, fp32/bf16/fp16 inputs, odd shapes, poisoned outputs,
never zeros as inputs."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, ops, philox, reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if torch.cuda.is_available() else "interpret"
SHAPES = [(1, 5), (3, 2), (7, 3, 5, 7), (3, 4, 9, 9), (2, 3000)]  # 2-D toys, odd images, > one tile
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def tables(sched="linear", pred="eps", weighting="min_snr", T=1000):
    s = fd.schedule(sched, T=T)
    w = fd.loss_weight(weighting, s, prediction=pred)
    coef = P.get(pred).table(s.alpha, s.sigma).to(DEVICE)
    return s.alpha.float().to(DEVICE), s.sigma.float().to(DEVICE), w.float().to(DEVICE), coef


def inputs(shape, dtype=torch.float32, seed=0, T=1000):
    g = torch.Generator().manual_seed(seed)
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype).to(DEVICE)
    eps = torch.randn(shape, generator=g).to(DEVICE)
    t = torch.randint(0, T, (shape[0],), generator=g).to(DEVICE)
    t[: (shape[0] + 1) // 2] = 7  # many samples on one timestep
    iw = (torch.rand(shape[0], generator=g) + 0.5).to(DEVICE)
    return x0, eps, t, iw


def filled_bins(T=1000, seed=3):
    """Bins that already hold values (the scatter accumulates) and non-zero pivots."""
    g = torch.Generator().manual_seed(seed)
    b = TimestepBins(T, 2, DEVICE)
    b.data = torch.randn(5, T, dtype=torch.float64, generator=g).to(DEVICE)
    b.pivots = (torch.randn(2, T, dtype=torch.float64, generator=g) * 0.1).to(DEVICE)
    return b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noise_with_explicit_eps_is_exact(shape, dtype):
    a, s, _, _ = tables()
    x0, eps, t, _ = inputs(shape, dtype)
    xt = ops.noise(x0, t, a, s, eps=eps, backend=BACKEND)
    assert xt.dtype == dtype
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=0)
    torch.testing.assert_close(xt, ref.noise(x0, t, a, s, eps), **exact)
    xt16 = ops.noise(x0, t, a, s, eps=eps, out_dtype=torch.bfloat16, backend=BACKEND)
    # one bf16 ulp: the interpreter's fp32→bf16 cast need not round like torch's
    torch.testing.assert_close(xt16, ref.noise(x0, t, a, s, eps, torch.bfloat16), rtol=2**-7, atol=0)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("weighting", ["min_snr", "simple", "speed"])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_loss_with_explicit_eps_matches_reference(pred, weighting, shape):
    a, s, w, coef = tables("flow" if pred == "flow" else "cosine", pred, weighting)
    x0, eps, t, iw = inputs(shape)
    p = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(DEVICE).requires_grad_()
    bins = filled_bins()
    before = bins.data.clone()
    mean, per, raw, weighted = ops.loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, eps=eps, bins=bins,
                                        backend=BACKEND)
    rp = p.detach().clone().requires_grad_()
    r_per, r_raw = ref.loss(rp, x0, eps, t, w, iw, coef)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, **TOL[torch.float32])
    torch.testing.assert_close(raw, r_raw, **TOL[torch.float32])
    torch.testing.assert_close(mean, r_per.mean(), **TOL[torch.float32])
    mean.backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(weighted, w[t] * r_raw, **TOL[torch.float32])
    expect = TimestepBins(1000, 2, DEVICE)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.stack([r_raw, w[t] * r_raw]))
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-5, atol=1e-7)  # fp32 losses, fp64 bins


def test_targets_are_the_named_predictions():
    """The coefficient tables reproduce eps, x0, v = a·eps - s·x0 and flow = eps - x0 written out."""
    s = fd.schedule("cosine", T=50)
    x0, eps = torch.randn(6, 3), torch.randn(6, 3)
    t = torch.tensor([0, 3, 10, 25, 40, 49])
    a, sg = s.alpha[t, None].float(), s.sigma[t, None].float()
    named = {"eps": eps, "x0": x0, "v": a * eps - sg * x0, "flow": eps - x0}
    for name, expect in named.items():
        got = ref.target(x0, eps, t, P.get(name).table(s.alpha, s.sigma))
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pred", ["eps", "v"])
def test_loss_low_precision_inputs(dtype, pred):
    a, s, w, coef = tables("linear", pred)
    x0, eps, t, iw = inputs((3, 4, 5, 5), dtype)
    p = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE).requires_grad_()
    mean, per, raw, _ = ops.loss(p, x0, t, w, iw, coef, eps=eps, backend=BACKEND)
    r_per, r_raw = ref.loss(p.detach(), x0, eps, t, w, iw, coef)  # fp32 math on the same inputs
    torch.testing.assert_close(per, r_per, rtol=1e-5, atol=1e-6)
    mean.backward()
    _, _, r_grad = ref.loss_and_grad(p.detach(), x0, eps, t, w, iw, coef)
    assert p.grad.dtype == dtype
    torch.testing.assert_close(p.grad, r_grad, **TOL[dtype])


def test_per_sample_upstream_gradient():
    """When the caller rescales each ℓ_b (a learned weighting), the gradient follows per sample."""
    _, _, w, coef = tables("linear", "v")
    x0, eps, t, iw = inputs((5, 6))
    p = torch.randn(5, 6).to(DEVICE).requires_grad_()
    c = torch.rand(5).to(DEVICE) + 0.5
    _, per, _, _ = ops.loss(p, x0, t, w, iw, coef, eps=eps, backend=BACKEND)
    (per * c).sum().backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = ref.loss(rp, x0, eps, t, w, iw, coef)
    (r_per * c).sum().backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_in_kernel_noise_is_the_reference_stream_and_shared_by_both_kernels(pred):
    """A draws philox(seed, offset + index); B regenerates the same eps: both against the reference
    computed with that stream."""
    a, s, w, coef = tables("flow" if pred == "flow" else "linear", pred)
    x0, _, t, iw = inputs((3, 2, 7, 7))
    xt, e = ops.noise(x0, t, a, s, seed=11, offset=12345, return_eps=True, backend=BACKEND)
    stream = philox.randn(x0.shape, 11, 12345, DEVICE)
    torch.testing.assert_close(e, stream, rtol=0, atol=1e-5)  # to rounding of log/cos
    torch.testing.assert_close(xt, ref.noise(x0, t, a, s, e), rtol=0, atol=0)
    p = torch.randn_like(x0).requires_grad_()
    mean, per, _, _ = ops.loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=11, offset=12345, backend=BACKEND)
    mean.backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = ref.loss(rp, x0, stream, t, w, iw, coef)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-4, atol=1e-7)


def test_noise_statistics_and_independence_from_blocks():
    a, s, _, _ = tables()
    x0 = torch.rand(4, 3000).to(DEVICE) + 0.5
    t = torch.tensor([1, 2, 3, 999]).to(DEVICE)
    runs = [ops.noise(x0, t, a, s, seed=5, offset=77, return_eps=True, backend=BACKEND, block=blk)[1]
            for blk in (256, 1024, 4096)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])  # keyed on element index only
    e = runs[0]
    assert abs(e.mean().item()) < 0.03 and abs(e.std().item() - 1) < 0.03
    other = ops.noise(x0, t, a, s, seed=6, offset=77, return_eps=True, backend=BACKEND)[1]
    shifted = ops.noise(x0, t, a, s, seed=5, offset=77 + 12000, return_eps=True, backend=BACKEND)[1]
    assert (e - other).abs().mean() > 0.5 and (e - shifted).abs().mean() > 0.5
    # offsets continue the stream: samples 1.. of offset 77 are samples 0.. of offset 77 + 3000
    cont = ops.noise(x0[:3], t[:3], a, s, seed=5, offset=77 + 3000, return_eps=True, backend=BACKEND)[1]
    assert torch.equal(cont, e[1:])


def test_workspace_is_left_clean_and_outputs_do_not_depend_on_history():
    """Kernel B resets its accumulators: repeated calls, other batch sizes in between, same results."""
    _, _, w, coef = tables("linear", "v")
    x0, eps, t, iw = inputs((5, 3, 4, 4))
    p = torch.randn(5, 3, 4, 4).to(DEVICE)
    first = ops.loss(p, x0, t, w, iw, coef, eps=eps, backend=BACKEND)
    x1, e1, t1, iw1 = inputs((2, 7), seed=4)
    ops.loss(torch.randn(2, 7).to(DEVICE), x1, t1, w, iw1, coef, eps=e1, backend=BACKEND)
    again = ops.loss(p, x0, t, w, iw, coef, eps=eps, backend=BACKEND)
    for u, v in zip(first, again):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_non_finite_samples_are_not_scattered():
    _, _, w, coef = tables("linear", "eps")
    x0, eps, t, iw = inputs((4, 6))
    p = torch.randn(4, 6).to(DEVICE)
    p[1, 2] = float("nan")
    p[3, 0] = float("inf")
    bins = TimestepBins(1000, 2, DEVICE)
    out = ops.loss(p, x0, t, w, iw, coef, eps=eps, bins=bins, backend=BACKEND)
    assert not torch.isfinite(out.loss)
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


def test_backend_errors():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ops.resolve_backend("cuda", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ops.resolve_backend("triton", torch.device("cpu"))
        assert ops.resolve_backend("auto", torch.device("cpu")) in ("torch", "native")
