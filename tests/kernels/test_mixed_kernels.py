"""The fused mixed-prediction kernel (interpreter on CPU, compiled on CUDA) against the reference:
every head set (flow sets on the flow schedule), both gate kinds, several weightings, fp32/bf16/fp16
network outputs, odd shapes, several programs per sample and channel chunks, pre-filled bins with
non-zero pivots; the gradients it writes in the forward pass against autograd of the reference."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import mixed as M
from fasttrain.kernels import TimestepBins, mixed_reference as mref, ops_mixed, philox

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if torch.cuda.is_available() else "interpret"
T = 1000
VP_SETS = [("eps", "x0"), ("eps", "v"), ("x0", "v"), ("eps", "x0", "v")]
FLOW_SETS = [("eps", "flow"), ("flow", "x0", "v", "eps")]
SHAPES = [(3, 2, 5, 7), (5, 3), (4, 1, 9, 9), (2, 4, 3, 5, 3)]  # images, 2-D-ish toys, 1 channel, 3 spatial dims
WEIGHTINGS = ["min_snr", "constant", "edm", "snr"]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def setup(heads, weighting="min_snr", aux=0.3):
    flow = "flow" in heads
    s = fd.schedule("flow", T=T) if flow else fd.schedule("linear", T=T, zero_terminal_snr=True)
    w = fd.loss_weight(weighting, s, "x0").float().to(DEVICE)
    return s, w, M.head_table(heads, s, aux_weight=aux).to(DEVICE)


def inputs(shape, H, pixel, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, C, S = shape[0], shape[1], shape[2:]
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype).to(DEVICE)
    eps = torch.randn(shape, generator=g).to(DEVICE)
    t = torch.randint(0, T, (B,), generator=g)
    t[: (B + 1) // 2] = 7  # many samples on one timestep
    t[-1] = T - 1  # zero-terminal SNR / the last flow step: the eps head is masked there
    iw = (torch.rand(B, generator=g) + 0.5).to(DEVICE)
    out = torch.randn(B, H * C + (H if pixel else 0), *S, generator=g)
    if pixel:
        out[:, H * C:] *= 2  # gate logits of a few units
    gate = None if pixel else (2 * torch.randn(B, H, generator=g)).to(DEVICE)
    return x0, eps, t.to(DEVICE), iw, out.to(dtype).to(DEVICE), gate


def filled_bins(V, seed=3):
    """Bins that already hold values (the scatter accumulates) and non-zero pivots."""
    g = torch.Generator().manual_seed(seed)
    b = TimestepBins(T, V, DEVICE)
    b.data = torch.randn(1 + 2 * V, T, dtype=torch.float64, generator=g).to(DEVICE)
    b.pivots = (torch.randn(V, T, dtype=torch.float64, generator=g) * 0.1).to(DEVICE)
    return b


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_()


def close_grads(a, b, dtype=torch.float32):
    tol = TOL[dtype]
    torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, b.abs().max().item()))


def run_and_compare(heads, pixel, shape, weighting, dtype=torch.float32, block=0, in_kernel_noise=False):
    s, w, tab = setup(heads, weighting)
    H = len(heads)
    x0, eps, t, iw, out, gate = inputs(shape, H, pixel, dtype)
    bins = filled_bins(2 + H)
    before = bins.data.clone()
    o, g = leaf(out), leaf(gate)
    kw = dict(seed=11, offset=4321) if in_kernel_noise else dict(eps=eps)
    res = ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=g, bins=bins, backend=BACKEND, block=block, **kw)
    res.loss.backward()
    if in_kernel_noise:
        eps = philox.noise(x0.shape, 11, 4321, DEVICE)
    ro, rg = leaf(out), leaf(gate)
    per, raw, wl, x0e = mref.loss(ro, x0, eps, t, w, iw, tab, rg)
    per.mean().backward()
    tol = TOL[torch.float32] if not in_kernel_noise else dict(rtol=1e-4, atol=1e-5)  # eps: log/cos rounding
    torch.testing.assert_close(res.per_sample, per, **tol)
    torch.testing.assert_close(res.raw, raw, **tol)
    torch.testing.assert_close(res.weighted, wl, **tol)
    torch.testing.assert_close(res.x0_error, x0e, **tol)
    torch.testing.assert_close(res.loss, per.mean(), **tol)
    assert o.grad.dtype == dtype
    close_grads(o.grad, ro.grad.to(dtype), dtype)
    if gate is not None:
        close_grads(g.grad, rg.grad)
    expect = TimestepBins(T, 2 + H, DEVICE)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.cat([raw[None], wl[None], x0e.T]).detach())
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-5, atol=1e-7)
    return res


CASES = [(h, g) for h in VP_SETS + FLOW_SETS for g in ("pixel", "timestep")]


@pytest.mark.parametrize("heads,gate", CASES)
def test_kernel_matches_reference_and_autograd(heads, gate):
    i = CASES.index((heads, gate))
    run_and_compare(heads, gate == "pixel", SHAPES[i % len(SHAPES)], WEIGHTINGS[i % len(WEIGHTINGS)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_low_precision_outputs(dtype, gate):
    """bf16/fp16 network outputs and data; fp32 math inside; gradients in the output's dtype."""
    run_and_compare(("eps", "x0", "v"), gate == "pixel", (3, 3, 5, 5), "min_snr", dtype)


@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_several_programs_per_sample_and_channel_chunks(gate):
    """Small tiles: pixels split over programs (the last-program protocol) and, for wide flat data,
    the channels split into chunks inside a program."""
    assert ops_mixed._budget(BACKEND, 32) == 32
    run_and_compare(("eps", "x0", "v"), gate == "pixel", (3, 5, 3, 3), "min_snr", block=32)
    run_and_compare(("x0", "v"), gate == "pixel", (2, 37), "constant", block=16)


def test_in_kernel_noise_is_the_reference_stream():
    run_and_compare(("eps", "v"), True, (3, 2, 6, 6), "min_snr", in_kernel_noise=True)


def test_torch_backend_closed_form_matches_autograd():
    """The torch backend's closed-form gradients (mixed_reference.loss_and_grad) against autograd, also
    for flat data (no spatial dims) with the timestep gate."""
    for heads, gate, shape in [(("eps", "x0", "v"), None, (4, 2, 3, 5)), (("eps", "flow"), "timestep", (4, 2, 3, 5)),
                               (("x0", "v"), "timestep", (5, 3))]:
        _, w, tab = setup(heads)
        x0, eps, t, iw, out, g = inputs(shape, len(heads), gate is None)
        per, raw, wl, x0e, gout, ggate = mref.loss_and_grad(out, x0, eps, t, w, iw, tab, g)
        ro, rg = leaf(out), leaf(g)
        rper = mref.loss(ro, x0, eps, t, w, iw, tab, rg)[0]
        rper.mean().backward()
        torch.testing.assert_close(per, rper.detach())
        close_grads(gout, ro.grad)
        if g is not None:
            close_grads(ggate, rg.grad)


@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_per_sample_upstream_gradient(gate):
    """A caller that rescales each ℓ_b (learned weighting) gets per-sample scaled gradients, also for the gate."""
    _, w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, g = inputs((5, 2, 3, 3), 2, gate == "pixel")
    c = torch.rand(5, device=DEVICE) + 0.5
    o, gg = leaf(out), leaf(g)
    res = ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=gg, eps=eps, backend=BACKEND)
    (res.per_sample * c).sum().backward()
    ro, rg = leaf(out), leaf(g)
    (mref.loss(ro, x0, eps, t, w, iw, tab, rg)[0] * c).sum().backward()
    close_grads(o.grad, ro.grad)
    if g is not None:
        close_grads(gg.grad, rg.grad)


def test_workspace_is_left_clean_and_outputs_do_not_depend_on_history():
    _, w, tab = setup(("eps", "x0", "v"))
    x0, eps, t, iw, out, _ = inputs((4, 3, 4, 4), 3, True)
    first = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=BACKEND)
    x1, e1, t1, iw1, o1, g1 = inputs((4, 3, 4, 4), 3, False, seed=5)  # same B, the other gate kind
    ops_mixed.mixed_loss(o1, x1, t1, w, iw1, tab, gate=g1, eps=e1, backend=BACKEND)
    again = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=BACKEND)
    for u, v in zip(first, again):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_non_finite_samples_are_not_scattered():
    _, w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((4, 2, 3), 2, True)
    out[1, 0, 2] = float("nan")
    out[3, 4, 1] = float("inf")  # a gate logit
    bins = TimestepBins(T, 4, DEVICE)
    res = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=bins, backend=BACKEND)
    assert not torch.isfinite(res.loss)
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


def test_contract_errors():
    _, w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((2, 3, 4), 2, True)
    with pytest.raises(ValueError, match="scatters 2 \\+ H = 4 values"):
        ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=TimestepBins(T, 2, DEVICE), backend="torch")
    with pytest.raises(ValueError, match=r"mixed output must be \[B, 8, \*S\]"):
        ops_mixed.mixed_loss(out[:, :7], x0, t, w, iw, tab, eps=eps, backend="torch")
    with pytest.raises(ValueError, match="per-sample gate must be"):
        ops_mixed.mixed_loss(out[:, :6], x0, t, w, iw, tab, gate=torch.zeros(2, 3, device=DEVICE), eps=eps)


def test_fake_and_autograd_registration():
    """register_fake agrees with the op, and the op traces inside torch.compile(fullgraph=True)."""
    _, w, tab = setup(("eps", "x0", "v"))
    x0, eps, t, iw, out, g = inputs((3, 2, 4, 4), 3, False)
    args = (out, x0, t, w, iw, tab, g, torch.zeros(5, T, dtype=torch.float64, device=DEVICE),
            torch.zeros(11, T, dtype=torch.float64, device=DEVICE), eps, 0, torch.zeros((), dtype=torch.int64, device=DEVICE),
            "torch", 0)
    torch.library.opcheck(ops_mixed._mixed_op, args, test_utils=("test_schema", "test_faketensor"))

    def step(o, gg, bins):
        return ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=gg, eps=eps, bins=bins, backend=BACKEND)

    torch._dynamo.reset()
    b_e, b_c = TimestepBins(T, 5, DEVICE), TimestepBins(T, 5, DEVICE)
    o_e, g_e, o_c, g_c = leaf(out), leaf(g), leaf(out), leaf(g)
    r_e = step(o_e, g_e, b_e)
    r_c = torch.compile(step, fullgraph=True, backend="aot_eager")(o_c, g_c, b_c)
    r_e.loss.backward()
    r_c.loss.backward()
    torch.testing.assert_close(r_c.loss, r_e.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(b_c.data, b_e.data, rtol=1e-6, atol=1e-9)  # the in-place scatter survives compile
    torch.testing.assert_close(o_c.grad, o_e.grad)
    torch.testing.assert_close(g_c.grad, g_e.grad)
