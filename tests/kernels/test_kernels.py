"""The Triton kernels (run by the interpreter on CPU, compiled on CUDA) against the PyTorch reference:
every prediction type, several weightings, fp32/bf16/fp16 inputs, odd shapes, poisoned outputs,
never zeros as inputs."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.kernels import ops, reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if torch.cuda.is_available() else "interpret"
SHAPES = [(1, 5), (3, 2), (7, 3, 5, 7), (3, 4, 9, 9), (2, 3000)]  # 2-D toys, odd images, > one tile
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def tables(sched="linear", pred="eps", weighting="min_snr", T=1000):
    s = fd.schedule(sched, T=T)
    w = fd.loss_weight(weighting, s, prediction=pred)
    return s, s.alpha.float().to(DEVICE), s.sigma.float().to(DEVICE), w.float().to(DEVICE)


def inputs(shape, dtype=torch.float32, seed=0, T=1000):
    g = torch.Generator().manual_seed(seed)
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype).to(DEVICE)
    eps = torch.randn(shape, generator=g).to(DEVICE)
    t = torch.randint(0, T, (shape[0],), generator=g).to(DEVICE)
    t[: (shape[0] + 1) // 2] = 7  # many samples on one timestep
    iw = (torch.rand(shape[0], generator=g) + 0.5).to(DEVICE)
    return x0, eps, t, iw


def poisoned_workspace(B):
    ws, cnt = ops.new_workspace(B, DEVICE)
    ws.fill_(float("nan"))
    cnt.fill_(12345)
    return ws, cnt


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noise_with_explicit_eps_is_exact(shape, dtype):
    _, a, s, _ = tables()
    x0, eps, t, _ = inputs(shape, dtype)
    ws = poisoned_workspace(shape[0])
    xt = ops.noise(x0, t, a, s, eps=eps, workspace=ws, backend=BACKEND)
    assert xt.dtype == dtype
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=0)
    torch.testing.assert_close(xt, ref.noise(x0, t, a, s, eps), **exact)
    assert (ws[0] == 0).all() and (ws[1] == 0).all()  # kernel A zeroed kernel B's workspace
    xt16 = ops.noise(x0, t, a, s, eps=eps, out_dtype=torch.bfloat16, backend=BACKEND)
    # one bf16 ulp: the interpreter's fp32→bf16 cast need not round like torch's
    torch.testing.assert_close(xt16, ref.noise(x0, t, a, s, eps, torch.bfloat16), rtol=2**-7, atol=0)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("weighting", ["min_snr", "simple", "speed"])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_loss_with_explicit_eps_matches_reference(pred, weighting, shape):
    sched = "flow" if pred == "flow" else "cosine"
    st, a, s, w = tables(sched, pred, weighting)
    x0, eps, t, iw = inputs(shape)
    p = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(DEVICE).requires_grad_()
    pivots = torch.randn(2, 1000, dtype=torch.float64, device=DEVICE) * 0.1
    bins = torch.randn(5, 1000, dtype=torch.float64, device=DEVICE)  # accumulates onto what is there
    bins0 = bins.clone()
    ws = poisoned_workspace(shape[0])
    ops.noise(x0, t, a, s, eps=eps, workspace=ws, backend=BACKEND)  # zeroes the workspace, as in a step
    mean, per, raw, weighted = ops.loss(p, x0, t, a, s, w, iw, pred, eps=eps, bins=bins, pivots=pivots, workspace=ws,
                              backend=BACKEND)
    rp = p.detach().clone().requires_grad_()
    r_per, r_raw = ref.loss(rp, x0, eps, t, a, s, w, iw, pred)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, **TOL[torch.float32])
    torch.testing.assert_close(raw, r_raw, **TOL[torch.float32])
    torch.testing.assert_close(mean, r_per.mean(), **TOL[torch.float32])
    mean.backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(weighted, w[t] * r_raw, **TOL[torch.float32])
    expect = bins0 + ref.scatter_stats(t, torch.stack([r_raw, w[t] * r_raw]).double() - pivots[:, t], 1000)
    torch.testing.assert_close(bins, expect, rtol=1e-5, atol=1e-7)  # fp32 per-sample losses, fp64 bins


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pred", ["eps", "v"])
def test_loss_low_precision_inputs(dtype, pred):
    st, a, s, w = tables("linear", pred)
    x0, eps, t, iw = inputs((3, 4, 5, 5), dtype)
    p = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE).requires_grad_()
    mean, per, raw, _ = ops.loss(p, x0, t, a, s, w, iw, pred, eps=eps, backend=BACKEND)
    r_per, r_raw = ref.loss(p.detach(), x0, eps, t, a, s, w, iw, pred)  # fp32 math on the same inputs
    torch.testing.assert_close(per, r_per, rtol=1e-5, atol=1e-6)
    mean.backward()
    _, _, r_grad = ref.loss_and_grad(p.detach(), x0, eps, t, a, s, w, iw, pred)
    assert p.grad.dtype == dtype
    torch.testing.assert_close(p.grad, r_grad, **TOL[dtype])


def test_per_sample_upstream_gradient():
    """When the caller rescales each ℓ_b (a learned weighting), the gradient follows per sample."""
    _, a, s, w = tables("linear", "v")
    x0, eps, t, iw = inputs((5, 6))
    p = torch.randn(5, 6).to(DEVICE).requires_grad_()
    c = torch.rand(5).to(DEVICE) + 0.5
    _, per, _, _ = ops.loss(p, x0, t, a, s, w, iw, "v", eps=eps, backend=BACKEND)
    (per * c).sum().backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = ref.loss(rp, x0, eps, t, a, s, w, iw, "v")
    (r_per * c).sum().backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_in_kernel_noise_is_shared_by_both_kernels(pred):
    """A's eps, recovered from x_t, is the eps B used: B's gradient equals the reference's with it."""
    _, a, s, w = tables("flow" if pred == "flow" else "linear", pred)
    x0, _, t, iw = inputs((3, 2, 7, 7))
    ws = poisoned_workspace(3)
    xt, e = ops.noise(x0, t, a, s, seed=11, offset=12345, workspace=ws, return_eps=True, backend=BACKEND)
    recovered = (xt - a[t].view(-1, 1, 1, 1) * x0) / s[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(recovered, e, rtol=1e-4, atol=1e-4)
    p = torch.randn_like(x0).requires_grad_()
    mean, per, _, _ = ops.loss(p, x0, t, a, s, w, iw, pred, seed=11, offset=12345, workspace=ws, backend=BACKEND)
    mean.backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = ref.loss(rp, x0, e, t, a, s, w, iw, pred)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)


def test_noise_statistics_and_independence_from_blocks():
    _, a, s, _ = tables()
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


def test_scatter_op_matches_reference():
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, 13, (301,), generator=g).to(DEVICE)
    t[:50] = 3
    raw, wl = torch.rand(301, generator=g).to(DEVICE) + 0.1, torch.rand(301, generator=g).to(DEVICE) + 0.1
    pivots = torch.rand(2, 13, dtype=torch.float64, generator=g).to(DEVICE)
    bins = torch.full((5, 13), 0.5, dtype=torch.float64, device=DEVICE)
    ops.scatter_stats(t, raw, wl, pivots, bins, backend=BACKEND)
    expect = 0.5 + ref.scatter_stats(t, torch.stack([raw, wl]).double() - pivots[:, t], 13)
    torch.testing.assert_close(bins, expect, rtol=1e-9, atol=1e-9)


def test_backend_errors():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ops.resolve_backend("cuda", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ops.resolve_backend("triton", torch.device("cpu"))
        assert ops.resolve_backend("auto", torch.device("cpu")) == "torch"
