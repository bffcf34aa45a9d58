"""CUDA-only checks (skipped elsewhere; bench/gpu_check.sh runs them on a GPU machine): the Triton
path, and the native CUDA ops (fasttrain._C) against the reference, Triton and the native CPU ops."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, native, philox, torch_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise
from fasttrain.models import build_model

pytestmark = pytest.mark.gpu


def test_trainer_step_has_no_host_sync(tmp_path):
    """The whole Trainer step, data included, with samplers that learn from statistics."""
    from fasttrain.configure import load_config
    from fasttrain.train import Trainer

    for sampler in ("speed", "loss_second_moment", "stratified"):
        tr = Trainer(load_config("default", [f"run_dir={tmp_path / sampler}", "train.device=cuda",
                                             f"diffusion.sampler={sampler}", "diffusion.stats_every=2",
                                             "train.progress=false", "parallel.precision=bf16"]))
        try:
            for _ in range(3):  # warm-up: allocations, autotuning, the first epoch's order
                tr.train_step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    tr.train_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        finally:
            tr.close()


def _needs_native_cuda():
    if not native.available("cuda"):
        pytest.skip("fasttrain._C was built without CUDA")


def _objective_and_model(backend="triton"):
    s = fd.schedule("linear").to("cuda")
    obj = fd.DiffusionObjective(s, "v", "min_snr", "speed", backend=backend).cuda()
    model = build_model("dit_tiny", in_channels=4, image_size=8).cuda()
    return obj, model


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_training_step_has_no_host_sync(backend):
    if backend == "native":
        _needs_native_cuda()
    obj, model = _objective_and_model(backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x0 = torch.randn(32, 4, 8, 8, device="cuda")
    g = torch.Generator("cuda").manual_seed(0)
    for warm in (True, False):  # the first step may allocate and autotune
        if not warm:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                loss, _ = obj(model, x0, None, g)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            obj.sync_stats()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _cuda_case(sched, weighting, pred, shape):
    s = fd.schedule(sched)
    w = fd.loss_weight(weighting, s, prediction=pred).float().cuda()
    x0 = torch.randn(shape, device="cuda")
    return s.alpha.float().cuda(), s.sigma.float().cuda(), w, x0, torch.randint(0, 1000, (shape[0],), device="cuda")


def test_diffusion_math_is_two_launches_plus_one_backward_scale():
    from torch.profiler import ProfilerActivity, profile

    a, sg, w, x0, t = _cuda_case("linear", "min_snr", "v", (64, 3, 64, 64))
    iw = torch.ones(64, device="cuda")
    coef = P.get("v").table(fd.schedule("linear").alpha, fd.schedule("linear").sigma).cuda()
    pred = torch.randn(64, 3, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bins = TimestepBins(1000, 2, "cuda")
    offset = torch.zeros((), dtype=torch.int64, device="cuda")

    def step():
        noise(x0, t, a, sg, seed=1, offset=offset, out_dtype=torch.bfloat16, backend="triton")
        out = diffusion_loss(pred, x0, t, w, iw, coef, seed=1, offset=offset, bins=bins, backend="triton")
        out.loss.backward()

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("noise_kernel" in k for k in kernels) == 1
    assert sum("loss_kernel" in k for k in kernels) == 1
    assert len(kernels) <= 4, kernels  # A, B, the backward scale (+ gradient accumulation into .grad)


def test_the_driver_sees_no_spills_in_the_compiled_triton_kernels():
    """What kernels/aot.py checks without a GPU (tests/kernels/test_aot.py), from the driver here: every
    Triton kernel the three ops compiled in this process, fp32 and bf16 models, loaded with 0 spills."""
    from fasttrain.kernels import triton_diffusion_loss, triton_mixed_loss, triton_noise
    from fasttrain.kernels.mixed_loss import mixed_loss
    from fasttrain.kernels.torch_ref_mixed_loss import NROWS

    a, sg, w, x0, t = _cuda_case("linear", "min_snr", "v", (8, 3, 32, 32))
    iw = torch.ones(8, device="cuda")
    for dt in (torch.float32, torch.bfloat16):
        noise(x0, t, a, sg, out_dtype=dt, backend="triton")
        diffusion_loss(torch.randn(8, 3, 32, 32, device="cuda", dtype=dt), x0, t, w, iw,
                       torch.rand(2, 1000, device="cuda"), backend="triton")
        for gate in (None, torch.randn(8, 2, device="cuda", dtype=dt)):
            mixed_loss(torch.randn(8, 6 + (2 if gate is None else 0), 32, 32, device="cuda", dtype=dt), x0, t, w, iw,
                       torch.rand(2, NROWS, 1000, device="cuda"), gate=gate, backend="triton")
    torch.cuda.synchronize()
    for k in (triton_noise.noise_kernel, triton_diffusion_loss.loss_kernel, triton_mixed_loss.mixed_loss_kernel):
        compiled = [c for cache in k.device_caches.values() for c in cache[0].values()]  # triton 3.8's layout
        assert compiled, k.fn.__name__
        assert all(c.n_spills == 0 for c in compiled), [(k.fn.__name__, c.n_regs, c.n_spills) for c in compiled]


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_bf16_model_input_and_gradient_dtypes(backend):
    if backend == "native":
        _needs_native_cuda()
    a, sg, w, x0, t = _cuda_case("cosine", "simple", "eps", (8, 4, 16, 16))
    s = fd.schedule("cosine")
    coef = P.get("eps").table(s.alpha, s.sigma).cuda()
    xt = noise(x0, t, a, sg, seed=0, offset=0, out_dtype=torch.bfloat16, backend=backend)
    assert xt.dtype == torch.bfloat16
    pred = xt.detach().clone().requires_grad_()
    out = diffusion_loss(pred, x0, t, w, torch.ones(8, device="cuda"), coef, uses=P.get("eps").uses, seed=0, offset=0,
                   backend=backend)
    out.loss.backward()
    assert pred.grad.dtype == torch.bfloat16 and torch.isfinite(pred.grad.float()).all()


# -- native CUDA ops (kernels/csrc/cuda) ------------------------------------------------------------
def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype).cuda()
    t = torch.randint(0, 1000, (shape[0],), generator=g)
    t[: (shape[0] + 1) // 2] = 7  # many samples on one timestep: the bins' atomics collide
    iw = (torch.rand(shape[0], generator=g) + 0.5).cuda()
    p = torch.randn(shape, generator=g).to(dtype).cuda()
    return x0, t.cuda(), iw, p


@pytest.mark.parametrize("pred", fd.PREDICTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 5), (7, 3, 5, 7), (3, 3, 37, 41)])
def test_native_cuda_matches_reference_and_triton(pred, dtype, shape):
    _needs_native_cuda()
    s = fd.schedule("flow" if pred == "flow" else "cosine")
    a, sg = s.alpha.float().cuda(), s.sigma.float().cuda()
    w = fd.loss_weight("min_snr", s, prediction=pred).float().cuda()
    coef = P.get(pred).table(s.alpha, s.sigma).cuda()
    x0, t, iw, p = _inputs(shape, dtype)
    offset = torch.tensor(2**32 - 50, device="cuda")  # the counter's high word changes inside the batch
    xt, e = noise(x0, t, a, sg, seed=2**40 + 3, offset=offset, return_eps=True, out_dtype=dtype, backend="native")
    _, e_tri = noise(x0, t, a, sg, seed=2**40 + 3, offset=offset, return_eps=True, backend="triton")
    _, e_cpu = noise(x0.cpu(), t.cpu(), a.cpu(), sg.cpu(), seed=2**40 + 3, offset=2**32 - 50, return_eps=True,
                         backend="native")
    torch.testing.assert_close(e, e_tri, rtol=0, atol=1e-5)  # Triton's tl.randn, to rounding
    torch.testing.assert_close(e.cpu(), e_cpu, rtol=0, atol=1e-6)  # the CPU ops' eps (same log/cos)
    torch.testing.assert_close(e.cpu(), philox.randn(shape, 2**40 + 3, 2**32 - 50), rtol=0, atol=1e-5)
    assert torch.equal(xt, torch_ref.noise(x0, t, a, sg, e, dtype))
    bins, expect = TimestepBins(1000, 2, "cuda"), TimestepBins(1000, 2, "cuda")
    bins.data.normal_()
    bins.pivots.normal_().mul_(0.1)
    expect.data, expect.pivots = bins.data.clone(), bins.pivots.clone()
    # Poison the caching allocator: the loss op's buffers (per-tile partial sums: B * ceil(D / 2048)
    # floats, and the outputs) come from freed blocks of their size full of NaN.
    tiles = shape[0] * -(-p[0].numel() // 2048)
    junk = [torch.full((tiles,), float("nan"), device="cuda") for _ in range(16)]
    del junk
    pg = p.clone().requires_grad_()
    mean, per, raw, wl = diffusion_loss(pg, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=2**40 + 3, offset=offset,
                                  bins=bins, backend="native")
    r_per, r_raw, r_grad = torch_ref.loss_and_grad(p, x0, e, t, w, iw, coef)
    torch.testing.assert_close(per, r_per, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(raw, r_raw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wl, w[t] * r_raw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mean, r_per.mean(), rtol=1e-4, atol=1e-6)
    mean.backward()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(pg.grad, r_grad, rtol=tol, atol=tol)
    expect.scatter_(t, torch.stack([r_raw, w[t] * r_raw]))
    torch.testing.assert_close(bins.data, expect.data, rtol=1e-4, atol=1e-7)
    # the same call on the Triton kernels
    t_out = diffusion_loss(p, x0, t, w, iw, coef, uses=P.get(pred).uses, seed=2**40 + 3, offset=offset,
                           backend="triton")
    torch.testing.assert_close(per, t_out.per_sample, rtol=1e-4, atol=1e-6)


def test_native_cuda_reads_the_offset_on_the_device():
    """An offset tensor on the GPU (what a captured graph advances) gives the CPU ops' stream."""
    _needs_native_cuda()
    s = fd.schedule("linear")
    a, sg = s.alpha.float(), s.sigma.float()
    x0 = torch.rand(4, 3000) + 0.5
    t = torch.tensor([1, 2, 3, 999])
    e_gpu = noise(x0.cuda(), t.cuda(), a.cuda(), sg.cuda(), seed=5, offset=torch.tensor(77, device="cuda"),
                      return_eps=True, backend="native")[1]
    e_cpu = noise(x0, t, a, sg, seed=5, offset=77, return_eps=True, backend="native")[1]
    torch.testing.assert_close(e_gpu.cpu(), e_cpu, rtol=0, atol=1e-6)
    assert abs(e_gpu.mean().item()) < 0.03 and abs(e_gpu.std().item() - 1) < 0.03
