"""The mixed-prediction loss op (kernels/mixed_loss.py) on every backend against the PyTorch reference
math (torch_ref_mixed_loss.py) and autograd of it: every head set (flow sets on the flow schedule), both
gate kinds, several weightings, fp32/bf16/fp16 outputs, data and gate, odd shapes (flat [B, C] data,
one channel, three spatial dims, chunks across channel boundaries, samples over several programs or
tasks), eps given and drawn in the op, pre-filled bins with non-zero pivots, masked heads at
zero-terminal SNR; the gradients written in the forward pass against autograd; outputs independent of
history and (native) of the thread count; every CPU kernel set; one-line errors; register_fake and
torch.compile(fullgraph=True)."""
import mixed_harness as mh
import pytest
import torch
from harness import TOL, backends
from mixed_harness import CASES, WEIGHTINGS, T, close, leaf

from fasttrain.kernels import TimestepBins, native
from fasttrain.kernels import mixed_loss as mixed_loss_module
from fasttrain.kernels import torch_ref_mixed_loss as mixed_ref
from fasttrain.kernels.mixed_loss import mixed_loss
from fasttrain.kernels.noise_prepare import prepare as prepare_noise

# images; flat toys; 1 channel; 3 spatial dims (the first four: the cycle of the Triton kernel's former
# tests); P = 323: chunks that cross channels; flat over two tasks per sample; 2 x 9000 pixels: several
# programs or tasks per sample, chunks within a channel
SHAPES = [(3, 2, 5, 7), (5, 3), (4, 1, 9, 9), (2, 4, 3, 5, 3), (2, 3, 17, 19), (2, 20000), (2, 2, 100, 90)]
ALL = ("torch", "triton", "native")


def setup(heads, weighting="min_snr", be=None):
    return mh.setup(heads, weighting, device=be.device)


def inputs(be, shape, H, pixel, dtype=torch.float32, seed=0):
    return mh.inputs(shape, H, pixel, dtype, seed, be.device)


def run_and_compare(be, heads, pixel, shape, weighting="min_snr", dtype=torch.float32, **kw):
    return mh.run_and_compare(be.name, heads, pixel, shape, weighting, dtype, device=be.device, **kw)


@backends(*ALL)
@pytest.mark.parametrize("heads,gate", CASES)
def test_matches_reference_and_autograd(backend, heads, gate):
    """Each case on two shapes of the cycle (which differ from the 5th case on), eps given and drawn."""
    i = CASES.index((heads, gate))
    for shape in dict.fromkeys([SHAPES[i % len(SHAPES)], SHAPES[i % 4]]):
        for op_noise in (False, True):
            run_and_compare(backend, heads, gate == "pixel", shape, WEIGHTINGS[i % len(WEIGHTINGS)], op_noise=op_noise)


@backends(*ALL, every_cpu_set=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_low_precision(backend, dtype, gate):
    """bf16/fp16 network outputs, data and gate; fp32 math inside; gradients in the inputs' dtypes; and
    fp32 with eps drawn in the op on chunks that cross channels."""
    run_and_compare(backend, ("eps", "x0", "v"), gate == "pixel", (3, 3, 5, 5), "min_snr", dtype)
    run_and_compare(backend, ("x0", "v"), gate == "pixel", (2, 3, 17, 19), op_noise=True)


@backends(*ALL)
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_several_programs_per_sample_and_channel_chunks(backend, gate):
    """Small Triton tiles (`block`; the other backends ignore it): pixels split over programs (the
    last-program protocol) and, for wide flat data, the channels split into chunks inside a program."""
    if backend.name in ("triton", "interpret"):
        from fasttrain.kernels import triton_mixed_loss

        assert triton_mixed_loss.budget(backend.name == "interpret", 32) == 32
    run_and_compare(backend, ("eps", "x0", "v"), gate == "pixel", (3, 5, 3, 3), "min_snr", block=32)
    run_and_compare(backend, ("x0", "v"), gate == "pixel", (2, 37), "constant", block=16)


@backends(*ALL)
def test_in_op_noise_is_the_reference_stream(backend):
    run_and_compare(backend, ("eps", "v"), True, (3, 2, 6, 6), "min_snr", op_noise=True)


@backends(*ALL)
@pytest.mark.parametrize("heads", [("eps", "x0", "v"), ("flow", "x0", "v", "eps")])
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_masked_heads_at_zero_terminal_snr(backend, heads, gate):
    """At t = T-1 (α = 0) the eps head cannot give x0: softmax weight exactly 0, so its gradient is its
    own-space aux term alone, its gate gradient 0, and its x0 error mean(x0²) (x̂0 := 0)."""
    w, tab = setup(heads, be=backend)
    H, C = len(heads), 2
    x0, eps, _, iw, out, gate_logits = inputs(backend, (4, C, 3, 5), H, gate == "pixel")
    t = torch.full((4,), T - 1, device=backend.device)
    i = heads.index("eps")
    assert tab[i, mixed_ref.BIAS, T - 1] == mixed_ref.MASKED
    o, g = leaf(out), leaf(gate_logits)
    res = mixed_loss(o, x0, t, w, iw, tab, gate=g, eps=eps, backend=backend.name)
    res.loss.backward()
    assert torch.isfinite(res.per_sample).all()
    torch.testing.assert_close(res.x0_error[:, i], x0.pow(2).flatten(1).mean(1), rtol=1e-6, atol=0)
    d = out[:, i * C:(i + 1) * C] - eps  # the eps head's own-space residual
    s = 2 * iw / x0[0].numel() / 4
    aux = tab[i, mixed_ref.AUX, T - 1]
    torch.testing.assert_close(o.grad[:, i * C:(i + 1) * C], (aux * s).view(-1, 1, 1, 1) * d, rtol=1e-6, atol=1e-9)
    gate_grad = o.grad[:, H * C + i] if gate == "pixel" else g.grad[:, i]
    assert torch.all(gate_grad == 0)
    run_and_compare(backend, heads, gate == "pixel", (4, C, 3, 5))  # t includes T-1


@backends(*ALL)
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_per_sample_upstream_gradient(backend, gate):
    """A caller that rescales each ℓ_b (learned weighting) gets per-sample scaled gradients, also for the gate."""
    w, tab = setup(("eps", "x0"), be=backend)
    x0, eps, t, iw, out, g = inputs(backend, (5, 2, 3, 3), 2, gate == "pixel")
    c = torch.rand(5, device=backend.device) + 0.5
    o, gg = leaf(out), leaf(g)
    res = mixed_loss(o, x0, t, w, iw, tab, gate=gg, eps=eps, backend=backend.name)
    (res.per_sample * c).sum().backward()
    ro, rg = leaf(out), leaf(g)
    (mixed_ref.loss(ro, x0, eps, t, w, iw, tab, rg)[0] * c).sum().backward()
    close(o.grad, ro.grad, TOL[torch.float32])
    if g is not None:
        close(gg.grad, rg.grad, TOL[torch.float32])


@backends(*ALL)
def test_outputs_do_not_depend_on_history(backend):
    """Bit-identical after a call with the other gate kind (the Triton kernel resets its workspace)."""
    w, tab = setup(("eps", "x0", "v"), be=backend)
    x0, eps, t, iw, out, _ = inputs(backend, (4, 3, 4, 4), 3, True)
    first = mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=backend.name)
    x1, e1, t1, iw1, o1, g1 = inputs(backend, (4, 3, 4, 4), 3, False, seed=5)  # same B, the other gate kind
    mixed_loss(o1, x1, t1, w, iw1, tab, gate=g1, eps=e1, backend=backend.name)
    again = mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend=backend.name)
    for u, v in zip(first, again):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@backends("native")
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_native_outputs_do_not_depend_on_the_thread_count(backend, gate):
    """Fixed-order reductions: bit-identical outputs, gradients and bins on 1 and 2 threads (two tasks
    per sample here, several samples per thread)."""
    w, tab = setup(("eps", "x0", "v"), be=backend)
    x0, _, t, iw, out, g = inputs(backend, (3, 2, 100, 90), 3, gate == "pixel")
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            bins = mh.filled_bins(5)
            r = torch.ops.fasttrain_C.mixed_loss(out, x0, t, w, iw, tab, g, bins.pivots, bins.data, None, 5,
                                                 torch.tensor(77))
            runs.append((*r, bins.data))
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(*runs):
        assert torch.equal(u, v)


@backends(*ALL)
def test_non_finite_samples_are_not_scattered(backend):
    w, tab = setup(("eps", "x0"), be=backend)
    x0, eps, t, iw, out, _ = inputs(backend, (4, 2, 3), 2, True)
    out[1, 0, 2] = float("nan")
    out[3, 4, 1] = float("inf")  # a gate logit
    bins = TimestepBins(T, 4, backend.device)
    res = mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=bins, backend=backend.name)
    assert not torch.isfinite(res.loss)
    assert torch.isfinite(res.per_sample[[0, 2]]).all()
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


@backends(*ALL)
def test_contract_errors(backend):
    """Checked before any backend runs: the same one-line errors everywhere."""
    w, tab = setup(("eps", "x0"), be=backend)
    x0, eps, t, iw, out, _ = inputs(backend, (2, 3, 4), 2, True)
    with pytest.raises(ValueError, match="scatters 2 \\+ H = 4 values"):
        mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=TimestepBins(T, 2, backend.device), backend=backend.name)
    with pytest.raises(ValueError, match=r"mixed output must be \[B, 8, \*S\]"):
        mixed_loss(out[:, :7], x0, t, w, iw, tab, eps=eps, backend=backend.name)
    with pytest.raises(ValueError, match="per-sample gate must be"):
        mixed_loss(out[:, :6], x0, t, w, iw, tab, gate=torch.zeros(2, 3, device=backend.device), eps=eps,
                   backend=backend.name)


@backends("native")
def test_native_bad_arguments_are_one_line_errors(backend):
    """The C++ op's own argument checks (it is also callable without the Python wrapper)."""
    w, tab = setup(("eps", "x0"), be=backend)
    x0, eps, t, iw, out, _ = inputs(backend, (2, 2, 3), 2, True)
    empty = torch.empty(0, 0, dtype=torch.float64)
    off = torch.tensor(0)

    def op(o=out, x=x0, tt=t, tb=tab, gate=None, bins=empty, piv=empty):
        return torch.ops.fasttrain_C.mixed_loss(o, x, tt, w, iw, tb, gate, piv, bins, eps, 0, off)

    with pytest.raises(RuntimeError, match="timestep 1000 outside"):
        op(tt=torch.tensor([0, 1000]))
    with pytest.raises(RuntimeError, match="head table must be"):
        op(tb=tab[:1])
    with pytest.raises(RuntimeError, match=r"out must be \[B, 6, \*S\]"):
        op(o=out[:, :5])
    with pytest.raises(RuntimeError, match="per-sample gate must be"):
        op(o=out[:, :4], gate=torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="out must be float32, bfloat16 or float16"):
        op(o=out.double())
    with pytest.raises(RuntimeError, match="bins must be float64"):
        b = TimestepBins(T, 2)
        op(bins=b.data, piv=b.pivots)


@backends("native")
def test_auto_runs_the_native_op_on_cpu(backend, monkeypatch):
    calls = []
    real = native.mixed_loss
    monkeypatch.setattr(native, "mixed_loss", lambda *a: calls.append(1) or real(*a))
    w, tab = setup(("eps", "x0"), be=backend)
    x0, eps, t, iw, out, _ = inputs(backend, (2, 2, 3), 2, True)
    mixed_loss(out, x0, t, w, iw, tab, eps=eps)
    mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend="torch")
    assert calls == [1]


@backends(*ALL)
def test_fake_registration(backend):
    """register_fake agrees with the op on this backend (schema, fake tensors)."""
    dev = backend.device
    w, tab = setup(("eps", "x0", "v"), be=backend)
    x0, eps, t, iw, out, g = inputs(backend, (3, 2, 4, 4), 3, False)
    args = (out, x0, t, w, iw, tab, g, torch.zeros(5, T, dtype=torch.float64, device=dev),
            torch.zeros(11, T, dtype=torch.float64, device=dev), eps, 0, torch.zeros((), dtype=torch.int64, device=dev),
            [], None, None, None, None, 0, None, backend.name, 0)
    torch.library.opcheck(mixed_loss_module._mixed_op, args, test_utils=("test_schema", "test_faketensor"))
    # with noise options and a loss shape (kernels/noise_spec.py, loss_shape.py)
    from fasttrain.kernels import noise_spec as ns

    spec, _ = prepare_noise(ns.NoiseOptions(offset=0.1, adaptive_scale=0.2, pyramid_iterations=3, perturbation=0.1), x0,
                         seed=0, offset=0, rows=torch.tensor([2, 0, 1], device=dev), backend=backend.name)
    c = torch.full((T,), 0.1, device=dev)
    args = args[:9] + (None,) + args[10:12] + tuple(ns.op_args(spec)) + (2, c, backend.name, 0)
    torch.library.opcheck(mixed_loss_module._mixed_op, args, test_utils=("test_schema", "test_faketensor"))


@backends(*ALL)
@pytest.mark.parametrize("given", [True, False], ids=["eps_given", "eps_drawn"])
def test_inside_fullgraph_compile(backend, given):
    """The op inside torch.compile(fullgraph=True): the same loss, x0 errors, gradients and in-place
    bins as eagerly (bit for bit on the native op, to fp32 rounding elsewhere)."""
    w, tab = setup(("eps", "x0", "v"), be=backend)
    x0, eps, t, iw, out, g = inputs(backend, (3, 2, 4, 4), 3, False)
    kw = dict(eps=eps) if given else dict(seed=3, offset=9)

    def step(o, gg, bins):
        return mixed_loss(o, x0, t, w, iw, tab, gate=gg, bins=bins, backend=backend.name, **kw)

    torch._dynamo.reset()
    b_e, b_c = TimestepBins(T, 5, backend.device), TimestepBins(T, 5, backend.device)
    o_e, g_e, o_c, g_c = leaf(out), leaf(g), leaf(out), leaf(g)
    r_e = step(o_e, g_e, b_e)
    r_c = torch.compile(step, fullgraph=True, backend="aot_eager")(o_c, g_c, b_c)
    r_e.loss.backward()
    r_c.loss.backward()
    assert b_c.data[0].sum() == 3  # the in-place scatter survives compile
    if backend.name == "native":
        assert torch.equal(r_c.loss, r_e.loss) and torch.equal(r_c.x0_error, r_e.x0_error)
        assert torch.equal(b_c.data, b_e.data)
        assert torch.equal(o_c.grad, o_e.grad) and torch.equal(g_c.grad, g_e.grad)
    else:
        torch.testing.assert_close(r_c.loss, r_e.loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(r_c.x0_error, r_e.x0_error, rtol=1e-6, atol=0)
        torch.testing.assert_close(b_c.data, b_e.data, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(o_c.grad, o_e.grad)
        torch.testing.assert_close(g_c.grad, g_e.grad)


# -- the reference contract ----------------------------------------------------------------------
def test_reference_closed_form_matches_autograd():
    """The torch backend's closed-form gradients (torch_ref_mixed_loss.loss_and_grad) against autograd of
    torch_ref_mixed_loss.loss, also for flat data (no spatial dims) with the timestep gate."""
    for heads, gate, shape in [(("eps", "x0", "v"), None, (4, 2, 3, 5)), (("eps", "flow"), "timestep", (4, 2, 3, 5)),
                               (("x0", "v"), "timestep", (5, 3))]:
        w, tab = mh.setup(heads)
        x0, eps, t, iw, out, g = mh.inputs(shape, len(heads), gate is None)
        per, raw, wl, x0e, gout, ggate = mixed_ref.loss_and_grad(out, x0, eps, t, w, iw, tab, g)
        ro, rg = leaf(out), leaf(g)
        rper = mixed_ref.loss(ro, x0, eps, t, w, iw, tab, rg)[0]
        rper.mean().backward()
        torch.testing.assert_close(per, rper.detach())
        close(gout, ro.grad, TOL[torch.float32])
        if g is not None:
            close(ggate, rg.grad, TOL[torch.float32])


@pytest.mark.gpu
def test_native_on_cuda_runs_the_reference_with_a_warning(monkeypatch):
    """No CUDA version of the native op (the Triton kernel is the GPU path): backend="native" on CUDA
    tensors runs the reference, and says so once."""
    if not native.available("cuda"):
        pytest.skip("fasttrain._C was built without its CUDA part")
    monkeypatch.setattr(mixed_loss_module, "_WARNED_NATIVE_CUDA", False)
    w, tab = mh.setup(("eps", "x0"))
    x0, eps, t, iw, out = (x.cuda() for x in mh.inputs((2, 2, 3), 2, True)[:5])
    args = (out, x0, t, w.cuda(), iw, tab.cuda())
    with pytest.warns(UserWarning, match="native mixed loss is CPU only"):
        res = mixed_loss(*args, eps=eps, backend="native")
    torch.testing.assert_close(res.per_sample, mixed_loss(*args, eps=eps, backend="torch").per_sample)


@backends(*ALL)
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_a_spec_without_options_is_the_plain_loss(backend, gate):
    """The options' path (kernels/noise_spec.py) with no option and the identity row map: the plain op's
    outputs and gradients bit for bit."""

    w, tab = setup(("eps", "x0", "v"), be=backend)
    x0, _, t, iw, out, g = inputs(backend, (3, 2, 5, 7), 3, gate == "pixel")
    spec, _ = prepare_noise(None, x0, seed=3, offset=9, rows=torch.arange(3, device=backend.device),
                         backend=backend.name)
    runs = []
    for sp in (None, spec):
        o, gg = leaf(out), leaf(g)
        res = mixed_loss(o, x0, t, w, iw, tab, gate=gg, seed=3, offset=9, spec=sp, backend=backend.name)
        res.loss.backward()
        runs.append((*res, o.grad) + ((gg.grad,) if gg is not None else ()))
    for u, v in zip(*runs):
        assert torch.equal(u, v)
