"""CUDA-only checks (skipped elsewhere; bench/gpu_check.sh runs them on a GPU machine)."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, ops
from fasttrain.models import build_model

pytestmark = pytest.mark.gpu


def test_trainer_step_has_no_host_sync(tmp_path):
    """The whole Trainer step, data included, with every kind of sampler that learns from statistics."""
    from fasttrain.config import load_config
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


def _cuda_case(sched, weighting, pred, shape):
    s = fd.schedule(sched)
    w = fd.loss_weight(weighting, s, prediction=pred).float().cuda()
    x0 = torch.randn(shape, device="cuda")
    coef = P.get(pred).table(s.alpha, s.sigma).cuda()
    return s.alpha.float().cuda(), s.sigma.float().cuda(), w, coef, x0, torch.randint(0, 1000, (shape[0],), device="cuda")


def test_diffusion_math_is_two_launches_plus_one_backward_scale():
    from torch.profiler import ProfilerActivity, profile

    a, sg, w, coef, x0, t = _cuda_case("linear", "min_snr", "v", (64, 3, 64, 64))
    iw = torch.ones(64, device="cuda")
    pred = torch.randn(64, 3, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bins = TimestepBins(1000, 2, "cuda")
    offset = torch.zeros((), dtype=torch.int64, device="cuda")

    def step():
        ops.noise(x0, t, a, sg, seed=1, offset=offset, out_dtype=torch.bfloat16)
        out = ops.loss(pred, x0, t, w, iw, coef, seed=1, offset=offset, bins=bins)
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


def test_bf16_model_input_and_gradient_dtypes():
    a, sg, w, coef, x0, t = _cuda_case("cosine", "simple", "eps", (8, 4, 16, 16))
    xt = ops.noise(x0, t, a, sg, seed=0, offset=0, out_dtype=torch.bfloat16)
    assert xt.dtype == torch.bfloat16
    pred = xt.detach().clone().requires_grad_()
    out = ops.loss(pred, x0, t, w, torch.ones(8, device="cuda"), coef, seed=0, offset=0)
    out.loss.backward()
    assert pred.grad.dtype == torch.bfloat16 and torch.isfinite(pred.grad.float()).all()


def test_objective_step_has_no_host_sync():
    s = fd.schedule("linear").to("cuda")
    obj = fd.DiffusionObjective(s, "v", "min_snr", "speed", backend="triton").cuda()
    model = build_model("dit_tiny", in_channels=4, image_size=8).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x0 = torch.randn(32, 4, 8, 8, device="cuda")
    g = torch.Generator("cuda").manual_seed(0)
    for warm in (True, False):
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
