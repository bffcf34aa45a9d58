"""The noise options (kernels/noise_spec.py) in the noise and loss ops, on every backend: each option
against its source's formula written out independently here (diffusers' and sd-scripts' noise offset,
sd-scripts' adaptive scale and random strengths, sd-scripts' pyramid_noise_like, Ning et al.'s input
perturbation, an immiscible row map), the random draws of the sources (torch.rand, Python's random)
checked by their moments; all options at once on odd shapes and every dtype against the reference;
the counter layout; the std reduction; one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from harness import DTYPES, backends, inputs, tables

from fasttrain.kernels import noise_spec as ns
from fasttrain.kernels import noise_std as noise_std_module
from fasttrain.kernels import philox, torch_ref
from fasttrain.kernels import torch_ref_noise as rn
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise, randn
from fasttrain.kernels.noise_prepare import prepare as prepare_noise
from fasttrain.kernels.torch_ref_noise_std import reference_std

SEED, OFF = 7, 1234
DRAWN = dict(rtol=1e-5, atol=2e-5)  # normals to the rounding of log/cos, sums of a few of them


def draw(backend, opts, shape, dtype=torch.float32, rows=None, n_rows=None, offset=OFF, seed=SEED):
    """(x0, t, tables, spec, counters, eps and x_t from the op) for options `opts` on `backend`."""
    dev = backend.device
    a, s, _, _ = tables(device=dev)
    x0, _, t, _ = inputs(shape, dtype, device=dev)
    spec, n = prepare_noise(opts, x0, seed=seed, offset=offset, rows=rows, n_rows=n_rows, backend=backend.name)
    xt, e = noise(x0, t, a, s, seed=seed, offset=offset, spec=spec, return_eps=True, backend=backend.name)
    return x0, t, (a, s), spec, n, e, xt


def base(shape, offset=OFF, seed=SEED, device="cpu"):
    return philox.randn(shape, seed, offset, device)


# -- each option against its source ----------------------------------------------------------------
@backends("torch", "triton", "native")
@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (2, 3)])
def test_offset_is_the_sources_formula(backend, shape):
    """diffusers/sd-scripts: noise + c·randn((B, C, 1, 1)) (the per-(sample, channel) normal at the
    layout's K_N), the same noise in x_t and in what the op returns for the target."""
    opts = ns.NoiseOptions(offset=0.1)
    x0, t, (a, s), spec, n, e, xt = draw(backend, opts, shape)
    B, C = shape[:2]
    per_bc = philox.randn((B, C), SEED, OFF + spec.ints[ns.K_N], backend.device)
    want = base(shape, device=backend.device) + 0.1 * per_bc.reshape(B, C, *([1] * (len(shape) - 2)))
    torch.testing.assert_close(e, want, **DRAWN)
    torch.testing.assert_close(xt, torch_ref.noise(x0, t, a, s, want), **DRAWN)
    assert n == x0.numel() + B * C


@backends("torch", "triton", "native")
def test_adaptive_and_random_offset_are_sd_scripts(backend):
    """sd-scripts apply_noise_offset: off = rand(1)·c (random strength), off + a·|latents.mean((2, 3))|
    clamped at 0 (adaptive; a < 0 makes the clamp bite), then noise + off·randn((B, C, 1, 1))."""
    shape = (4, 3, 6, 5)
    for adaptive in (0.7, -3.0):
        opts = ns.NoiseOptions(offset=0.2, offset_random=True, adaptive_scale=adaptive)
        x0, _, _, spec, _, e, _ = draw(backend, opts, shape)
        u = rn.rand(SEED, torch.tensor([OFF + spec.ints[ns.K_S]]))[0].to(backend.device)
        off = u * 0.2
        off = torch.clamp(off + adaptive * x0.mean(dim=(2, 3), keepdim=True).abs(), min=0)
        want = base(shape, device=backend.device) + off * philox.randn((4, 3), SEED, OFF + spec.ints[ns.K_N],
                                                                        backend.device)[..., None, None]
        torch.testing.assert_close(e, want, **DRAWN)
        if adaptive < 0:
            assert (off == 0).any() and (off > 0).any()


def sd_scripts_pyramid(noise0, rs, iterations, discount, level_noise):
    """sd-scripts' pyramid_noise_like, written out: Python's `random.random()*2 + 2` replaced by rs[i]
    (the stream's draws), torch.randn of each level by `level_noise(i, shape)`."""
    b, c, w, h = noise0.shape
    up = torch.nn.Upsample(size=(w, h), mode="bilinear")
    noise = noise0.clone()
    for i in range(iterations):
        r = rs[i]
        wn, hn = max(1, int(w / (r ** i))), max(1, int(h / (r ** i)))
        noise += up(level_noise(i, (b, c, wn, hn))) * discount ** i
        if wn == 1 or hn == 1:
            break
    return noise / noise.std()


@backends("torch", "triton", "native")
@pytest.mark.parametrize("shape, iterations, discount", [((2, 3, 16, 12), 6, 0.3), ((3, 2, 9, 7), 10, 0.8),
                                                         ((2, 1, 40, 3), 3, 0.5)])
def test_pyramid_is_sd_scripts_pyramid_noise_like(backend, shape, iterations, discount):
    """Levels, sizes (int() truncation, the break after a side of 1), bilinear upsampling
    (align_corners False), the weights discount^i and the division by the global unbiased std."""
    opts = ns.NoiseOptions(pyramid_iterations=iterations, pyramid_discount=discount)
    _, _, _, spec, n, e, _ = draw(backend, opts, shape)
    dev = backend.device
    u = rn.rand(SEED, torch.arange(iterations) + OFF + spec.ints[ns.K_S] + 2)
    rs = [2.0 + 2.0 * float(v) for v in u]
    N = math.prod(shape)

    def level_noise(i, sz):
        return philox.randn(sz, SEED, OFF + spec.ints[ns.K_L] + i * N, dev)

    want = sd_scripts_pyramid(base(shape, device=dev), rs, iterations, discount, level_noise)
    torch.testing.assert_close(e, want, **DRAWN)
    torch.testing.assert_close(spec.std, reference_std(spec, shape, SEED, OFF, dev), rtol=2e-6, atol=0)
    assert n == N + 2 + iterations + iterations * N


def test_pyramid_draws_and_sizes_have_the_sources_distribution():
    """r ~ U[2, 4) per level as Python's random.random()*2 + 2 (moments over many steps), and the live
    levels stop after the first side of 1 (8×8 images: never more than 4 levels)."""
    opts = ns.NoiseOptions(pyramid_iterations=8)
    spec = ns.NoiseSpec(ns.layout(opts, (1, 1, 8, 8)).ints, opts.table(), None, None, torch.ones(()))
    rs, lives = [], []
    for step in range(400):
        _, _, r = rn.draws(spec, 3, step * 10_000, "cpu")
        rs.append(r)
        lives.append(len(rn.level_sizes(r, 8, 8)))
    r = torch.stack(rs)
    assert ((r >= 2) & (r < 4)).all()
    assert abs(r.mean().item() - 3) < 0.02 and abs(r.var().item() - 1 / 3) < 0.02
    assert max(lives) <= 4 and min(lives) >= 2


@backends("torch", "triton", "native")
@pytest.mark.parametrize("random_strength", [False, True])
def test_input_perturbation_builds_x_t_only(backend, random_strength):
    """Ning et al. 2023 (diffusers --input_perturbation, sd-scripts ip_noise_gamma): x_t from
    noise + γ·randn_like (γ·rand(1) for the random strength), the target from the unperturbed noise."""
    shape = (3, 2, 5, 5)
    opts = ns.NoiseOptions(perturbation=0.1, perturbation_random=random_strength)
    x0, t, (a, s), spec, n, e, xt = draw(backend, opts, shape)
    dev = backend.device
    g = 0.1 * (rn.rand(SEED, torch.tensor([OFF + spec.ints[ns.K_S] + 1]))[0].item() if random_strength else 1.0)
    xi = philox.randn(shape, SEED, OFF + spec.ints[ns.K_XI], dev)
    eps = base(shape, device=dev)
    torch.testing.assert_close(e, eps, **DRAWN)
    torch.testing.assert_close(xt, torch_ref.noise(x0, t, a, s, eps + g * xi), **DRAWN)
    _, _, w, coef = tables(pred="eps", device=dev)
    p = torch.randn(shape, device=dev)
    out = diffusion_loss(p, x0, t, w, torch.ones(3, device=dev), coef, seed=SEED, offset=OFF, spec=spec,
                         backend=backend.name)
    torch.testing.assert_close(out.raw, (p - eps).pow(2).flatten(1).mean(1), **DRAWN)


def test_random_strengths_have_the_sources_distribution():
    """One U[0, 1) per batch, as torch.rand(1) in sd-scripts: moments over many steps."""
    opts = ns.NoiseOptions(offset=0.1, offset_random=True, perturbation=0.1, perturbation_random=True)
    spec = ns.NoiseSpec(ns.layout(opts, (2, 3)).ints, opts.table(), None, None, None)
    u = torch.stack([torch.stack(rn.draws(spec, 5, step * 977, "cpu")[:2]) for step in range(2000)])
    assert ((u >= 0) & (u < 1)).all()
    for col in u.T:
        assert abs(col.mean().item() - 0.5) < 0.02 and abs(col.var().item() - 1 / 12) < 0.01
    assert abs(torch.corrcoef(u.T)[0, 1].item()) < 0.08


@backends("torch", "triton", "native")
def test_rows_pick_the_noise_of_other_rows(backend):
    """Immiscible assignment: sample b takes the base noise of row rows[b] (a permutation, or rows of a
    k·B candidate range for knn), and the loss op regenerates the same."""
    shape = (4, 2, 3, 3)
    D = 18
    dev = backend.device
    for rows, n_rows in [(torch.tensor([2, 0, 3, 1]), None), (torch.tensor([5, 0, 11, 7]), 12)]:
        rows = rows.to(dev)
        x0, t, _, spec, n, e, _ = draw(backend, ns.NoiseOptions(), shape, rows=rows, n_rows=n_rows)
        cand = base(((n_rows or 4), 2, 3, 3), device=dev)
        torch.testing.assert_close(e, cand[rows], **DRAWN)
        assert n == (n_rows or 4) * D
        _, _, w, coef = tables(pred="eps", device=dev)
        p = torch.randn(shape, device=dev)
        out = diffusion_loss(p, x0, t, w, torch.ones(4, device=dev), coef, seed=SEED, offset=OFF, spec=spec,
                             backend=backend.name)
        torch.testing.assert_close(out.raw, (p - cand[rows]).pow(2).flatten(1).mean(1), **DRAWN)


# -- all options at once, every backend against the reference ---------------------------------------
ALL = ns.NoiseOptions(offset=0.1, offset_random=True, adaptive_scale=0.5, pyramid_iterations=6, pyramid_discount=0.4,
                      perturbation=0.1, perturbation_random=True)
SHAPES = [(3, 4, 9, 7), (2, 3, 40, 41), (1, 1, 5, 130)]


@backends("torch", "triton", "native", every_cpu_set=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_all_options_match_the_reference(backend, shape, dtype):
    """Every option at once, with a row map, fp32/bf16/fp16 data and outputs: x_t and ε against the
    reference math on the op's own std; that std against Tensor.std of the reference noise."""
    dev = backend.device
    B = shape[0]
    rows = torch.arange(B - 1, -1, -1, device=dev)
    x0, t, (a, s), spec, _, e, _ = draw(backend, ALL, shape, dtype, rows=rows)
    want = rn.reference_eps(spec, shape, SEED, OFF, dev)
    torch.testing.assert_close(e, want, **DRAWN)
    torch.testing.assert_close(spec.std, reference_std(spec, shape, SEED, OFF, dev), rtol=2e-6, atol=0)
    xi = rn.reference_perturbation(spec, shape, SEED, OFF, dev)
    for out in DTYPES:
        junk = [torch.full(shape, float("nan"), dtype=out, device=dev) for _ in range(3)]  # poisoned memory
        del junk
        xt = noise(x0, t, a, s, seed=SEED, offset=OFF, spec=spec, out_dtype=out, backend=backend.name)
        ref = torch_ref.noise(x0, t, a, s, want + xi, out)
        assert xt.dtype == out and torch.isfinite(xt).all()
        tol = DRAWN if out == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(xt.float(), ref.float(), **tol)


@backends("torch", "triton", "native")
def test_spec_noise_is_independent_of_tiles_and_threads(backend):
    """The same ε for any Triton tile and (native) any thread count; a device counter as the offset."""
    dev = backend.device
    a, s, _, _ = tables(device=dev)
    x0, _, t, _ = inputs((2, 3, 40, 41), device=dev)
    spec, _ = prepare_noise(ALL, x0, seed=SEED, offset=OFF, backend=backend.name)
    runs = [noise(x0, t, a, s, seed=SEED, offset=torch.tensor(OFF, device=dev), spec=spec, return_eps=True,
                  backend=backend.name, block=blk)[1] for blk in (256, 4096)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs.append(noise(x0, t, a, s, seed=SEED, offset=OFF, spec=spec, return_eps=True, backend=backend.name)[1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


# -- layout, helpers, errors --------------------------------------------------------------------------
def test_layout_without_options_is_the_plain_stream():
    assert ns.layout(None, (4, 3, 8, 8)).counters == 4 * 192
    assert ns.layout(ns.NoiseOptions(), (4, 3, 8, 8), rows=12).counters == 12 * 192
    lay = ns.layout(ALL, (4, 3, 8, 8))
    f, L, C, H, W, kxi, kn, ks, kl = lay.ints
    N = 4 * 192
    assert (C, H, W, L) == (3, 8, 8, 6) and kxi == N and kn == 2 * N and ks == kn + 12 and kl == ks + 8
    assert lay.counters == kl + 6 * N


@backends("torch", "triton", "native")
def test_randn_is_the_plain_stream(backend):
    e = randn((3, 5, 7), seed=SEED, offset=OFF, device=backend.device, backend=backend.name)
    torch.testing.assert_close(e, base((3, 5, 7), device=backend.device), rtol=0, atol=1e-5)


def test_one_line_errors():
    x0 = torch.rand(2, 3)
    a, s, _, _ = tables(device="cpu")
    t = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="pyramid noise needs \\[B, C, H, W\\]"):
        prepare_noise(ns.NoiseOptions(pyramid_iterations=2), x0, seed=0, offset=0)
    with pytest.raises(ValueError, match="adaptive noise offset scale needs a noise offset"):
        ns.NoiseOptions(adaptive_scale=0.1)
    with pytest.raises(ValueError, match="must lie in \\[0, 16\\]"):
        ns.NoiseOptions(pyramid_iterations=17)
    spec, _ = prepare_noise(ns.NoiseOptions(offset=0.1), x0, seed=0, offset=0)
    with pytest.raises(ValueError, match="either eps or a noise spec"):
        noise(x0, t, a, s, eps=torch.randn(2, 3), spec=spec, backend="torch")
    with pytest.raises(ValueError, match="another shape"):
        noise(torch.rand(2, 4), t, a, s, spec=spec, backend="torch")
    with pytest.raises(RuntimeError, match="noise row 5 outside \\[0, 2\\)"):
        spec, _ = prepare_noise(None, x0, seed=0, offset=0, rows=torch.tensor([0, 5]))
        noise(x0, t, a, s, spec=spec, backend="native")


def test_reference_matches_interpolate_written_out():
    """The reference's bilinear level is F.interpolate's; a 1-pixel field upsamples to a constant."""
    z = torch.randn(1, 1, 1, 3)
    up = F.interpolate(z, size=(4, 5), mode="bilinear", align_corners=False)
    assert torch.equal(up[0, 0, 0], up[0, 0, 3])


@backends("triton", "native")
def test_options_inside_fullgraph_compile_and_opcheck(backend):
    """The noise and loss ops with a noise spec and a loss shape inside torch.compile(fullgraph=True)
    (aot_eager), equal to eager; register_fake of the noise, noise_std and loss ops (opcheck)."""
    from fasttrain.kernels import diffusion_loss as dl_module
    from fasttrain.kernels import noise as noise_module

    torch._dynamo.reset()
    dev = backend.device
    a, s, w, coef = tables("linear", "v", device=dev)
    x0, _, t, iw = inputs((3, 2, 8, 6), device=dev)
    c = torch.full((1000,), 0.1, device=dev)
    rows = torch.tensor([1, 2, 0], device=dev)
    spec, _ = prepare_noise(ALL, x0, seed=SEED, offset=OFF, rows=rows, backend=backend.name)
    lin = torch.nn.Linear(6, 6).to(dev)

    def step(x0, spec):
        x_t = noise(x0, t, a, s, seed=SEED, offset=OFF, spec=spec, backend=backend.name)
        out = diffusion_loss(lin(x_t), x0, t, w, iw, coef, seed=SEED, offset=OFF, spec=spec, loss="pseudo_huber",
                             c_table=c, backend=backend.name)
        return out.loss, out.raw

    eager = step(x0, spec)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x0, spec)
    for u, v in zip(eager, compiled):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-7)
    off = torch.tensor(OFF, device=dev)
    args = ns.op_args(spec)
    torch.library.opcheck(noise_module._noise_op, (x0, t, a, s, None, SEED, off, torch.float32, True, *args,
                                                   backend.name, 0), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(noise_std_module._std_op, (x0, SEED, off, *args[:4], backend.name, 0),
                          test_utils=("test_schema", "test_faketensor"))
    bins = torch.zeros(5, 1000, dtype=torch.float64, device=dev)
    piv = torch.zeros(2, 1000, dtype=torch.float64, device=dev)
    torch.library.opcheck(dl_module._loss_op, (x0.clone(), x0, t, w, iw, coef, piv, bins, None, SEED, off, 3, *args,
                                               4, c, backend.name, 0), test_utils=("test_schema", "test_faketensor"))
