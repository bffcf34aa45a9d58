"""The native C++ CPU ops (fasttrain._C, kernels/csrc/) against the PyTorch reference, and their noise
against the Triton interpreter's: every prediction type and weighting, fp32/bf16/fp16, odd shapes,
samples over several tiles, pre-filled bins with non-zero pivots, never zeros as inputs; every CPU
kernel set this processor supports (default, avx2, avx512). torch.compile(fullgraph=True) and
DiffusionObjective on the native ops: test_compile_and_objective.py. CUDA: test_gpu.py."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, native, ops, philox, reference as ref

from test_kernels import TOL, filled_bins, inputs, tables  # the Triton tests' helpers (same inputs)
# `capability` (every CPU kernel set): tests/kernels/conftest.py

pytestmark = pytest.mark.skipif(not native.available("cpu"), reason="fasttrain._C is not built")
# (1, 5), (3, 2): 2-D toys; odd images; 2 x 40000: several 16384-element tiles and a chunk tail
SHAPES = [(1, 5), (3, 2), (7, 3, 5, 7), (3, 4, 9, 9), (2, 40000)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_auto_backend_is_native_on_cpu():
    assert ops.resolve_backend("auto", torch.device("cpu")) == "native"
    assert torch.ops.fasttrain_C.cpu_capability() in ("default", "avx2", "avx512")


@pytest.mark.parametrize("seed, offset", [(0, 0), (11, 12345), (2**40 + 5, 2**32 - 300), (2**63 - 1, 2**63 - 200)])
def test_philox_words_are_the_reference_bits(capability, seed, offset):
    """Words 0 and 1 bit for bit, across the 2^32 carry of the counter and with 64-bit seeds."""
    words = torch.ops.fasttrain_C.philox_words(seed, offset, 1037)
    w0, w1, _, _ = philox.philox4x32(seed, torch.arange(1037) + offset)
    assert torch.equal(words[0], w0) and torch.equal(words[1], w1)


@pytest.mark.parametrize("seed, offset", [(11, 12345), (2**40 + 5, 2**32 - 100)])
def test_eps_is_the_triton_stream(capability, seed, offset):
    """The same (seed, offset) gives the Triton interpreter's eps (tl.randn) to float32 rounding."""
    a, s, _, _ = tables()
    x0, _, t, _ = inputs((3, 2, 7, 7))
    _, e = ops.noise(x0, t, a, s, seed=seed, offset=offset, return_eps=True, backend="native")
    _, e_triton = ops.noise(x0, t, a, s, seed=seed, offset=offset, return_eps=True, backend="interpret")
    torch.testing.assert_close(e, e_triton, rtol=0, atol=1e-5)
    torch.testing.assert_close(e, philox.randn(x0.shape, seed, offset), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_matches_reference(capability, shape, dtype):
    """x_t equals the reference bit for bit for the eps it used, in every input and output dtype."""
    a, s, _, _ = tables()
    x0, eps, t, _ = inputs(shape, dtype)
    xt = ops.noise(x0, t, a, s, eps=eps.to(dtype), backend="native")
    assert xt.dtype == dtype and torch.equal(xt, ref.noise(x0, t, a, s, eps.to(dtype)))
    for out in DTYPES:
        xt, e = ops.noise(x0, t, a, s, seed=3, offset=77, out_dtype=out, return_eps=True, backend="native")
        assert xt.dtype == out and torch.equal(xt, ref.noise(x0, t, a, s, e, out))
        torch.testing.assert_close(e, philox.randn(shape, 3, 77), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("weighting", ["min_snr", "simple", "speed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_loss_matches_reference(pred, weighting, shape):
    a, s, w, coef = tables("flow" if pred == "flow" else "cosine", pred, weighting)
    x0, eps, t, iw = inputs(shape)
    p = torch.randn(shape, generator=torch.Generator().manual_seed(9)).requires_grad_()
    bins = filled_bins()
    before = bins.data.clone()
    mean, per, raw, weighted = ops.loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=5, offset=99, bins=bins,
                                        backend="native")
    e = philox.randn(shape, 5, 99)  # the stream the op drew
    rp = p.detach().clone().requires_grad_()
    r_per, r_raw = ref.loss(rp, x0, e, t, w, iw, coef)
    r_per.mean().backward()
    torch.testing.assert_close(per, r_per, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(raw, r_raw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weighted, w[t] * r_raw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mean, r_per.mean(), rtol=1e-4, atol=1e-6)
    mean.backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-4, atol=1e-8)
    expect = TimestepBins(1000, 2)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.stack([r_raw, w[t] * r_raw]))
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("pred_dtype", DTYPES)
@pytest.mark.parametrize("x0_dtype", DTYPES)
@pytest.mark.parametrize("pred", ["eps", "v"])
def test_loss_dtypes_with_explicit_eps(capability, pred_dtype, x0_dtype, pred):
    """fp32 math on the same inputs: the gradient to one rounding of pred's dtype, the sums to fp32."""
    a, s, w, coef = tables("linear", pred)
    x0, eps, t, iw = inputs((3, 4, 5, 5), x0_dtype)
    p = torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(2)).to(pred_dtype).requires_grad_()
    mean, per, raw, _ = ops.loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, eps=eps, backend="native")
    r_per, r_raw, r_grad = ref.loss_and_grad(p.detach(), x0, eps, t, w, iw, coef)
    torch.testing.assert_close(per, r_per, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(raw, r_raw, rtol=1e-5, atol=1e-6)
    mean.backward()
    assert p.grad.dtype == pred_dtype
    torch.testing.assert_close(p.grad, r_grad, **TOL[pred_dtype])


def test_per_sample_upstream_gradient():
    _, _, w, coef = tables("linear", "v")
    x0, eps, t, iw = inputs((5, 6))
    p = torch.randn(5, 6).requires_grad_()
    c = torch.rand(5) + 0.5
    _, per, _, _ = ops.loss(p, x0, t, w, iw, coef, eps=eps, backend="native")
    (per * c).sum().backward()
    rp = p.detach().clone().requires_grad_()
    r_per, _ = ref.loss(rp, x0, eps, t, w, iw, coef)
    (r_per * c).sum().backward()
    torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-8)


def test_results_do_not_depend_on_threads_history_or_garbage():
    """Fixed-order reductions: bit-identical with 1 or 2 threads, after other calls, and after the
    allocator handed back memory full of NaN."""
    _, _, w, coef = tables("linear", "v")
    x0, _, t, iw = inputs((6, 3, 40, 40))
    p = torch.randn(6, 3, 40, 40)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.loss(p, x0, t, w, iw, coef, seed=1, offset=3, backend="native")
        torch.set_num_threads(2)
        ops.loss(torch.randn(2, 7), x0[:2, 0, 0, :7], t[:2], w, iw[:2], coef, seed=2, backend="native")
        junk = [torch.full_like(p, float("nan")) for _ in range(4)]  # freed: their memory comes back
        del junk
        two = ops.loss(p, x0, t, w, iw, coef, seed=1, offset=3, backend="native")
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(one, two):
        assert torch.equal(u, v)


def test_offsets_continue_the_stream():
    a, s, _, _ = tables()
    x0 = torch.rand(4, 3000) + 0.5
    t = torch.tensor([1, 2, 3, 999])
    e = ops.noise(x0, t, a, s, seed=5, offset=77, return_eps=True, backend="native")[1]
    cont = ops.noise(x0[:3], t[:3], a, s, seed=5, offset=torch.tensor(77 + 3000), return_eps=True,
                     backend="native")[1]
    assert torch.equal(cont, e[1:])
    assert abs(e.mean().item()) < 0.03 and abs(e.std().item() - 1) < 0.03


def test_non_finite_samples_are_not_scattered():
    _, _, w, coef = tables("linear", "eps")
    x0, eps, t, iw = inputs((4, 6))
    p = torch.randn(4, 6)
    p[1, 2], p[3, 0] = float("nan"), float("inf")
    bins = TimestepBins(1000, 2)
    out = ops.loss(p, x0, t, w, iw, coef, eps=eps, bins=bins, backend="native")
    assert not torch.isfinite(out.loss)
    assert bins.data[0].sum().item() == 2 and torch.isfinite(bins.data).all()


def test_bad_arguments_are_one_line_errors():
    a, s, w, coef = tables()
    x0, _, t, iw = inputs((3, 5))
    with pytest.raises(RuntimeError, match="timestep 1000 outside"):
        ops.noise(x0, torch.tensor([0, 1, 1000]), a, s, backend="native")
    with pytest.raises(RuntimeError, match="x0 must be float32, bfloat16 or float16"):
        ops.noise(x0.double(), t, a, s, backend="native")
    with pytest.raises(ValueError, match="unknown CPU capability"):
        torch.ops.fasttrain_C.cpu_capability("avx1024")
