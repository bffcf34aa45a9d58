"""The noise op (kernels/noise.py) on every backend against the PyTorch reference math (torch_ref.noise):
odd shapes (2-D toys, odd images, samples over several tiles), fp32/bf16/fp16 data and outputs, eps
given and drawn from the Philox stream (philox.py), every CPU kernel set of the native ops; the stream's
statistics and its independence from tiles and offsets; the native op's one-line errors."""
import pytest
import torch
from harness import DTYPES, TRITON, assert_same, backends, device_of, inputs, tables

from fasttrain import diffusion as fd
from fasttrain.kernels import philox, torch_ref
from fasttrain.kernels.noise import noise
from fasttrain.kernels.noise_prepare import prepare as prepare_noise

# (1, 5), (3, 2): 2-D toys; odd images; 2 x 3000: more than one GPU tile; 2 x 40000: several
# 16384-element tiles (interpreter, native) and a chunk tail
SHAPES = [(1, 5), (3, 2), (7, 3, 5, 7), (3, 4, 9, 9), (2, 3000), (2, 40000)]


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_noise_matches_reference(backend, shape, dtype):
    """x_t for a given eps (fp32, and in the data's dtype) and for the eps the op draws, in every output
    dtype: bit for bit where the backend rounds like torch, else to one rounding of the output dtype."""
    a, s, _, _ = tables(device=backend.device)
    x0, eps, t, _ = inputs(shape, dtype, device=backend.device)
    for e in (eps, eps.to(dtype)):
        xt = noise(x0, t, a, s, eps=e, backend=backend.name)
        assert xt.dtype == dtype
        assert_same(xt, torch_ref.noise(x0, t, a, s, e), backend)
    for out in DTYPES:
        assert_same(noise(x0, t, a, s, eps=eps, out_dtype=out, backend=backend.name),
                    torch_ref.noise(x0, t, a, s, eps, out), backend)
    for out in DTYPES:
        xt, e = noise(x0, t, a, s, seed=3, offset=77, out_dtype=out, return_eps=True, backend=backend.name)
        assert xt.dtype == out
        assert_same(xt, torch_ref.noise(x0, t, a, s, e, out), backend)
        torch.testing.assert_close(e, philox.randn(shape, 3, 77, backend.device), rtol=0, atol=1e-5)


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("seed, offset", [(11, 12345), (2**40 + 5, 2**32 - 100)])
def test_drawn_eps_is_the_one_stream(backend, seed, offset):
    """The same (seed, offset) gives philox.randn's eps and the Triton kernel's (tl.randn) to float32
    rounding of log and cos, across the 2^32 carry of the counter and with 64-bit seeds."""
    a, s, _, _ = tables(device=backend.device)
    x0, _, t, _ = inputs((3, 2, 7, 7), device=backend.device)
    _, e = noise(x0, t, a, s, seed=seed, offset=offset, return_eps=True, backend=backend.name)
    torch.testing.assert_close(e, philox.randn(x0.shape, seed, offset, backend.device), rtol=0, atol=1e-5)
    dev = device_of(TRITON)
    a, s, x0, t = a.to(dev), s.to(dev), x0.to(dev), t.to(dev)
    _, e_triton = noise(x0, t, a, s, seed=seed, offset=offset, return_eps=True, backend=TRITON)
    torch.testing.assert_close(e.cpu(), e_triton.cpu(), rtol=0, atol=1e-5)


@backends("torch", "triton", "native")
def test_noise_statistics_and_independence_from_blocks_and_offsets(backend):
    dev = backend.device
    a, s, _, _ = tables(device=dev)
    x0 = torch.rand(4, 3000).to(dev) + 0.5
    t = torch.tensor([1, 2, 3, 999]).to(dev)
    runs = [noise(x0, t, a, s, seed=5, offset=77, return_eps=True, backend=backend.name, block=blk)[1]
            for blk in (256, 1024, 4096)]  # `block`: the Triton tile; the other backends ignore it
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])  # keyed on element index only
    e = runs[0]
    assert abs(e.mean().item()) < 0.03 and abs(e.std().item() - 1) < 0.03
    other = noise(x0, t, a, s, seed=6, offset=77, return_eps=True, backend=backend.name)[1]
    shifted = noise(x0, t, a, s, seed=5, offset=77 + 12000, return_eps=True, backend=backend.name)[1]
    assert (e - other).abs().mean() > 0.5 and (e - shifted).abs().mean() > 0.5
    # offsets continue the stream: samples 1.. of offset 77 are samples 0.. of offset 77 + 3000, whether
    # the offset is an int or a device counter
    for off in (77 + 3000, torch.tensor(77 + 3000, device=dev)):
        cont = noise(x0[:3], t[:3], a, s, seed=5, offset=off, return_eps=True, backend=backend.name)[1]
        assert torch.equal(cont, e[1:])


@backends("native")
def test_native_bad_arguments_are_one_line_errors(backend):
    """The C++ op's argument checks (the other backends index the tables as torch does)."""
    a, s, _, _ = tables(device=backend.device)
    x0, _, t, _ = inputs((3, 5), device=backend.device)
    with pytest.raises(RuntimeError, match="timestep 1000 outside"):
        noise(x0, torch.tensor([0, 1, 1000]), a, s, backend="native")
    with pytest.raises(RuntimeError, match="x0 must be float32, bfloat16 or float16"):
        noise(x0.double(), t, a, s, backend="native")
    with pytest.raises(ValueError, match="unknown CPU capability"):
        torch.ops.fasttrain_C.cpu_capability("avx1024")


def test_reference_noise_and_dtype():
    """The contract itself (torch_ref.noise) against the formula written out: x_t in x0's dtype."""
    s = fd.schedule("linear", T=100)
    x0 = torch.randn(3, 4).bfloat16()
    eps = torch.randn(3, 4)
    t = torch.tensor([0, 50, 99])
    x_t = torch_ref.noise(x0, t, s.alpha, s.sigma, eps)
    assert x_t.dtype == torch.bfloat16
    expect = s.alpha[t, None].float() * x0.float() + s.sigma[t, None].float() * eps
    torch.testing.assert_close(x_t.float(), expect, atol=2e-2, rtol=1e-2)


@backends("torch", "triton", "native")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_spec_without_options_is_the_plain_stream(backend, dtype):
    """The options' path (kernels/noise_spec.py) with no option and the identity row map draws the plain
    kernel's ε and x_t bit for bit, and advances the counter as the plain step."""

    a, s, _, _ = tables(device=backend.device)
    x0, _, t, _ = inputs((3, 4, 9, 9), dtype, device=backend.device)
    rows = torch.arange(3, device=backend.device)
    spec, n = prepare_noise(None, x0, seed=9, offset=321, rows=rows, backend=backend.name)
    assert spec is not None and n == x0.numel()
    plain = noise(x0, t, a, s, seed=9, offset=321, return_eps=True, backend=backend.name)
    spec_path = noise(x0, t, a, s, seed=9, offset=321, spec=spec, return_eps=True, backend=backend.name)
    for u, v in zip(plain, spec_path):
        assert torch.equal(u, v)
