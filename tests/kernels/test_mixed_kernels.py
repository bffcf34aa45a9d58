"""The fused mixed-prediction kernel (interpreter on CPU, compiled on CUDA) against the reference:
every head set (flow sets on the flow schedule), both gate kinds, several weightings, fp32/bf16/fp16
network outputs, odd shapes, several programs per sample and channel chunks, pre-filled bins with
non-zero pivots; the gradients it writes in the forward pass against autograd of the reference."""
import pytest
import torch

from fasttrain.kernels import TimestepBins, mixed_reference as mref, ops_mixed

import mixed_harness as mh
from mixed_harness import T, CASES, WEIGHTINGS, leaf
from test_kernels import TOL

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if torch.cuda.is_available() else "interpret"
SHAPES = [(3, 2, 5, 7), (5, 3), (4, 1, 9, 9), (2, 4, 3, 5, 3)]  # images, 2-D-ish toys, 1 channel, 3 spatial dims


def setup(heads, weighting="min_snr"):
    return mh.setup(heads, weighting, device=DEVICE)


def inputs(shape, H, pixel, dtype=torch.float32, seed=0):
    return mh.inputs(shape, H, pixel, dtype, seed, DEVICE)


def close_grads(a, b):
    mh.close(a, b, TOL[torch.float32])


def run_and_compare(heads, pixel, shape, weighting="min_snr", dtype=torch.float32, **kw):
    return mh.run_and_compare(BACKEND, heads, pixel, shape, weighting, dtype, device=DEVICE, **kw)


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
    run_and_compare(("eps", "v"), True, (3, 2, 6, 6), "min_snr", op_noise=True)


def test_torch_backend_closed_form_matches_autograd():
    """The torch backend's closed-form gradients (mixed_reference.loss_and_grad) against autograd, also
    for flat data (no spatial dims) with the timestep gate."""
    for heads, gate, shape in [(("eps", "x0", "v"), None, (4, 2, 3, 5)), (("eps", "flow"), "timestep", (4, 2, 3, 5)),
                               (("x0", "v"), "timestep", (5, 3))]:
        w, tab = setup(heads)
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
    w, tab = setup(("eps", "x0"))
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
    w, tab = setup(("eps", "x0", "v"))
    x0, eps, t, iw, out, _ = inputs((4, 3, 4, 4), 3, True)
    first = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=BACKEND)
    x1, e1, t1, iw1, o1, g1 = inputs((4, 3, 4, 4), 3, False, seed=5)  # same B, the other gate kind
    ops_mixed.mixed_loss(o1, x1, t1, w, iw1, tab, gate=g1, eps=e1, backend=BACKEND)
    again = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=BACKEND)
    for u, v in zip(first, again):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_non_finite_samples_are_not_scattered():
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((4, 2, 3), 2, True)
    out[1, 0, 2] = float("nan")
    out[3, 4, 1] = float("inf")  # a gate logit
    bins = TimestepBins(T, 4, DEVICE)
    res = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=bins, backend=BACKEND)
    assert not torch.isfinite(res.loss)
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


def test_contract_errors():
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((2, 3, 4), 2, True)
    with pytest.raises(ValueError, match="scatters 2 \\+ H = 4 values"):
        ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=TimestepBins(T, 2, DEVICE), backend="torch")
    with pytest.raises(ValueError, match=r"mixed output must be \[B, 8, \*S\]"):
        ops_mixed.mixed_loss(out[:, :7], x0, t, w, iw, tab, eps=eps, backend="torch")
    with pytest.raises(ValueError, match="per-sample gate must be"):
        ops_mixed.mixed_loss(out[:, :6], x0, t, w, iw, tab, gate=torch.zeros(2, 3, device=DEVICE), eps=eps)


def test_fake_and_autograd_registration():
    """register_fake agrees with the op, and the op traces inside torch.compile(fullgraph=True)."""
    w, tab = setup(("eps", "x0", "v"))
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
