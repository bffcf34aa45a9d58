"""The native C++ CPU mixed-prediction loss (fasttrain_C::mixed_loss, kernels/csrc/cpu/mixed.cpp) against
the reference (mixed_reference.py): every head set (flow sets on the flow schedule), both gates, several
weightings, fp32/bf16/fp16, odd shapes (flat [B, C] data, one channel, three spatial dims, chunks across
channel boundaries, samples over several tasks), pre-filled bins with non-zero pivots, masked heads at
zero-terminal SNR; the gradients it writes in the forward pass against autograd of the reference; the
same bits on 1 and 2 threads; every CPU kernel set; inside torch.compile(fullgraph=True). The Triton
kernel's tests: test_mixed_kernels.py."""
import pytest
import torch

from fasttrain.kernels import TimestepBins, mixed_reference as mref, native, ops_mixed

import mixed_harness as mh
from mixed_harness import T, CASES, WEIGHTINGS, close, filled_bins, inputs, leaf, setup
from test_kernels import TOL  # `capability` (every CPU kernel set): tests/kernels/conftest.py

pytestmark = pytest.mark.skipif(not native.available("cpu"), reason="fasttrain._C is not built")
# images; flat toys; 1 channel; 3 spatial dims; P = 323: chunks that cross channels; flat over two
# tasks per sample; 2 x 9000 pixels: pixel blocks (two tasks per sample, chunks within a channel)
SHAPES = [(3, 2, 5, 7), (5, 3), (4, 1, 9, 9), (2, 4, 3, 5, 3), (2, 3, 17, 19), (2, 20000), (2, 2, 100, 90)]


def run_and_compare(heads, pixel, shape, weighting="min_snr", dtype=torch.float32, in_op_noise=True):
    return mh.run_and_compare("native", heads, pixel, shape, weighting, dtype, op_noise=in_op_noise)


@pytest.mark.parametrize("heads,gate", CASES)
def test_native_matches_reference_and_autograd(heads, gate):
    """Odd cases draw eps in the op (the Philox stream), even ones take it explicitly."""
    i = CASES.index((heads, gate))
    run_and_compare(heads, gate == "pixel", SHAPES[i % len(SHAPES)], WEIGHTINGS[i % len(WEIGHTINGS)],
                    in_op_noise=i % 2 == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_low_precision_on_every_kernel_set(capability, dtype, gate):
    """bf16/fp16 network outputs, data and gate; fp32 math inside; gradients in the inputs' dtypes."""
    run_and_compare(("eps", "x0", "v"), gate == "pixel", (3, 3, 5, 5), dtype=dtype, in_op_noise=False)
    run_and_compare(("x0", "v"), gate == "pixel", (2, 3, 17, 19))  # fp32, eps in the op


@pytest.mark.parametrize("heads", [("eps", "x0", "v"), ("flow", "x0", "v", "eps")])
@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_masked_heads_at_zero_terminal_snr(heads, gate):
    """At t = T-1 (α = 0) the eps head cannot give x0: softmax weight exactly 0, so its gradient is its
    own-space aux term alone, its gate gradient 0, and its x0 error mean(x0²) (x̂0 := 0)."""
    w, tab = setup(heads)
    H, C = len(heads), 2
    x0, eps, _, iw, out, gate_logits = inputs((4, C, 3, 5), H, gate == "pixel")
    t = torch.full((4,), T - 1)
    i = heads.index("eps")
    assert tab[i, mref.BIAS, T - 1] == mref.MASKED
    o, g = leaf(out), leaf(gate_logits)
    res = ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=g, eps=eps, backend="native")
    res.loss.backward()
    assert torch.isfinite(res.per_sample).all()
    torch.testing.assert_close(res.x0_error[:, i], x0.pow(2).flatten(1).mean(1), rtol=1e-6, atol=0)
    d = out[:, i * C:(i + 1) * C] - eps  # the eps head's own-space residual
    s = 2 * iw / x0[0].numel() / 4
    aux = tab[i, mref.AUX, T - 1]
    torch.testing.assert_close(o.grad[:, i * C:(i + 1) * C], (aux * s).view(-1, 1, 1, 1) * d, rtol=1e-6, atol=1e-9)
    gate_grad = o.grad[:, H * C + i] if gate == "pixel" else g.grad[:, i]
    assert torch.all(gate_grad == 0)
    run_and_compare(heads, gate == "pixel", (4, C, 3, 5), in_op_noise=False)  # t includes T-1


@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_results_do_not_depend_on_the_thread_count(gate):
    """Fixed-order reductions: bit-identical outputs, gradients and bins on 1 and 2 threads (two tasks
    per sample here, several samples per thread)."""
    w, tab = setup(("eps", "x0", "v"))
    x0, _, t, iw, out, g = inputs((3, 2, 100, 90), 3, gate == "pixel")
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            bins = filled_bins(5)
            r = torch.ops.fasttrain_C.mixed_loss(out, x0, t, w, iw, tab, g, bins.pivots, bins.data, None, 5,
                                                 torch.tensor(77))
            runs.append((*r, bins.data))
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(*runs):
        assert torch.equal(u, v)


def test_non_finite_samples_are_not_scattered():
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((4, 2, 3), 2, True)
    out[1, 0, 2] = float("nan")
    out[3, 4, 1] = float("inf")  # a gate logit
    bins = TimestepBins(T, 4)
    res = ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, bins=bins, backend="native")
    assert not torch.isfinite(res.loss)
    assert torch.isfinite(res.per_sample[[0, 2]]).all()
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_per_sample_upstream_gradient(gate):
    """A caller that rescales each ℓ_b (learned weighting) gets per-sample scaled gradients."""
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, g = inputs((5, 2, 3, 3), 2, gate == "pixel")
    c = torch.rand(5) + 0.5
    o, gg = leaf(out), leaf(g)
    (ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=gg, eps=eps, backend="native").per_sample * c).sum().backward()
    ro, rg = leaf(out), leaf(g)
    (mref.loss(ro, x0, eps, t, w, iw, tab, rg)[0] * c).sum().backward()
    close(o.grad, ro.grad, TOL[torch.float32])
    if g is not None:
        close(gg.grad, rg.grad, TOL[torch.float32])


def test_auto_runs_the_native_op_on_cpu(monkeypatch):
    calls = []
    real = native.mixed_loss
    monkeypatch.setattr(native, "mixed_loss", lambda *a: calls.append(1) or real(*a))
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((2, 2, 3), 2, True)
    ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps)
    ops_mixed.mixed_loss(out, x0, t, w, iw, tab, eps=eps, backend="torch")
    assert calls == [1]


def test_bad_arguments_are_one_line_errors():
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out, _ = inputs((2, 2, 3), 2, True)
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


def test_inside_fullgraph_compile():
    """The native backend through the custom op inside torch.compile(fullgraph=True): the same loss,
    gradients and in-place bins as eagerly."""
    w, tab = setup(("eps", "x0", "v"))
    x0, _, t, iw, out, g = inputs((3, 2, 4, 4), 3, False)

    def step(o, gg, bins):
        return ops_mixed.mixed_loss(o, x0, t, w, iw, tab, gate=gg, seed=3, offset=9, bins=bins, backend="native")

    torch._dynamo.reset()
    b_e, b_c = TimestepBins(T, 5), TimestepBins(T, 5)
    o_e, g_e, o_c, g_c = leaf(out), leaf(g), leaf(out), leaf(g)
    r_e = step(o_e, g_e, b_e)
    r_c = torch.compile(step, fullgraph=True, backend="aot_eager")(o_c, g_c, b_c)
    r_e.loss.backward()
    r_c.loss.backward()
    assert torch.equal(r_c.loss, r_e.loss) and torch.equal(r_c.x0_error, r_e.x0_error)
    assert torch.equal(b_c.data, b_e.data) and b_c.data[0].sum() == 3  # the in-place scatter survives compile
    assert torch.equal(o_c.grad, o_e.grad) and torch.equal(g_c.grad, g_e.grad)


@pytest.mark.gpu
def test_native_on_cuda_runs_the_reference_with_a_warning(monkeypatch):
    """No CUDA version of the native op (the Triton kernel is the GPU path): backend="native" on CUDA
    tensors runs the reference, and says so once."""
    if not native.available("cuda"):
        pytest.skip("fasttrain._C was built without its CUDA part")
    monkeypatch.setattr(ops_mixed, "_WARNED_NATIVE_CUDA", False)
    w, tab = setup(("eps", "x0"))
    x0, eps, t, iw, out = (x.cuda() for x in inputs((2, 2, 3), 2, True)[:5])
    args = (out, x0, t, w.cuda(), iw, tab.cuda())
    with pytest.warns(UserWarning, match="native mixed loss is CPU only"):
        res = ops_mixed.mixed_loss(*args, eps=eps, backend="native")
    torch.testing.assert_close(res.per_sample, ops_mixed.mixed_loss(*args, eps=eps, backend="torch").per_sample)
