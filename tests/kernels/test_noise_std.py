"""The noise_std op (kernels/noise_std.py) on every backend against its PyTorch reference math
(torch_ref_noise_std.reference_std): the pyramid noise's unbiased std over the batch, on odd shapes,
every data dtype and every combination of options that reaches it; the noise op divides by it (unit
std); its custom op's schema and fake; one-line errors."""
import pytest
import torch
from harness import DTYPES, backends, inputs, tables

from fasttrain.kernels import noise_spec as ns
from fasttrain.kernels import noise_std as noise_std_module
from fasttrain.kernels.noise import noise
from fasttrain.kernels.noise_prepare import prepare as prepare_noise
from fasttrain.kernels.noise_std import noise_std
from fasttrain.kernels.torch_ref_noise_std import reference_std

SEED, OFF = 11, 4321
OPTIONS = {"pyramid": ns.NoiseOptions(pyramid_iterations=3, pyramid_discount=0.7),
           "offset+pyramid": ns.NoiseOptions(offset=0.3, offset_random=True, adaptive_scale=0.5, pyramid_iterations=4),
           "all": ns.NoiseOptions(offset=0.2, pyramid_iterations=2, perturbation=0.1, perturbation_random=True)}


def _spec(opts, x0, rows=None):
    """The spec as noise_prepare.prepare lays it out, without its std (what the op computes)."""
    lay = ns.layout(opts, x0.shape, None if rows is None else x0.shape[0])
    mean = ns.pixel_mean(x0) if opts.flags & ns.ADAPTIVE else None
    return ns.NoiseSpec(lay.ints, opts.table(x0.device), rows, mean, None)


# odd shapes, every data dtype and every group of options, each at least once
CASES = [((3, 2, 9, 7), DTYPES[0], "pyramid"), ((2, 3, 16, 12), DTYPES[1], "offset+pyramid"),
         ((1, 1, 5, 33), DTYPES[2], "all"), ((3, 2, 9, 7), DTYPES[2], "offset+pyramid"),
         ((2, 3, 16, 12), DTYPES[0], "all")]


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("shape, dtype, options", CASES)
def test_std_matches_the_reference(backend, shape, dtype, options):
    dev = backend.device
    x0, _, _, _ = inputs(shape, dtype, device=dev)
    rows = torch.arange(shape[0], device=dev).flip(0) if options == "all" else None
    spec = _spec(OPTIONS[options], x0, rows)
    got = noise_std(x0, spec, seed=SEED, offset=OFF, backend=backend.name)
    want = reference_std(spec, shape, SEED, OFF, dev)
    assert got.shape == () and got.dtype == torch.float32 and got.device == x0.device
    torch.testing.assert_close(got, want.reshape(()), rtol=1e-5, atol=0)
    assert 0.5 < float(got) < 3  # a std of the summed levels, not of zeros


@backends("torch", "triton", "native")
def test_the_adaptive_offset_makes_the_std_depend_on_x0(backend):
    dev = backend.device
    opts = OPTIONS["offset+pyramid"]
    x0, _, _, _ = inputs((3, 2, 8, 8), device=dev)
    a = noise_std(x0, _spec(opts, x0), seed=SEED, offset=OFF, backend=backend.name)
    b = noise_std(x0 * 3, _spec(opts, x0 * 3), seed=SEED, offset=OFF, backend=backend.name)
    c = noise_std(x0, _spec(opts, x0), seed=SEED, offset=OFF + 1, backend=backend.name)
    assert float(a) != float(b) and float(a) != float(c)


@backends("torch", "triton", "native")
def test_the_noise_op_divides_by_it(backend):
    """prepare() reduces the std with this op; the ε the noise op returns then has unit std."""
    dev = backend.device
    a, s, _, _ = tables(device=dev)
    x0, _, t, _ = inputs((4, 3, 16, 16), device=dev)
    spec, _ = prepare_noise(OPTIONS["pyramid"], x0, seed=SEED, offset=OFF, backend=backend.name)
    torch.testing.assert_close(spec.std, noise_std(x0, _spec(OPTIONS["pyramid"], x0), seed=SEED, offset=OFF,
                                                   backend=backend.name))
    _, e = noise(x0, t, a, s, seed=SEED, offset=OFF, spec=spec, return_eps=True, backend=backend.name)
    torch.testing.assert_close(e.std(), torch.ones((), device=dev), rtol=1e-5, atol=0)


@backends("torch", "triton", "native")
def test_op_schema_and_fake(backend):
    dev = backend.device
    x0, _, _, _ = inputs((2, 3, 8, 6), device=dev)
    ints, table, rows, mean, _ = ns.op_args(_spec(OPTIONS["offset+pyramid"], x0))
    torch.library.opcheck(noise_std_module._std_op, (x0, SEED, torch.tensor(OFF, device=dev), ints, table, rows,
                                                     mean, backend.name, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_one_line_errors():
    x0 = torch.rand(2, 3, 8, 8)
    spec = _spec(OPTIONS["pyramid"], x0)
    with pytest.raises(ValueError, match="laid out for another shape"):
        noise_std(torch.rand(2, 4, 8, 8), spec, seed=SEED, offset=OFF, backend="torch")
    with pytest.raises(ValueError, match="unknown backend"):
        noise_std(x0, spec, seed=SEED, offset=OFF, backend="cuda")
