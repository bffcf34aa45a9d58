"""CUDA-only checks (skipped elsewhere; bench/gpu_check.sh runs them on a GPU machine)."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.kernels import ops
from fasttrain.models import build_model

pytestmark = pytest.mark.gpu


def _objective_and_model():
    s = fd.schedule("linear").to("cuda")
    obj = fd.DiffusionObjective(s, "v", "min_snr", "speed", backend="triton").cuda()
    model = build_model("dit_tiny", in_channels=4, image_size=8).cuda()
    return obj, model


def test_training_step_has_no_host_sync():
    obj, model = _objective_and_model()
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
    pred = torch.randn(64, 3, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bins = torch.zeros(5, 1000, dtype=torch.float64, device="cuda")
    piv = torch.zeros(2, 1000, dtype=torch.float64, device="cuda")

    def step():
        ws = ops.new_workspace(64, "cuda")
        ops.noise(x0, t, a, sg, seed=1, offset=0, workspace=ws, out_dtype=torch.bfloat16)
        out = ops.loss(pred, x0, t, a, sg, w, iw, "v", seed=1, offset=0, workspace=ws, bins=bins, pivots=piv)
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
    a, sg, w, x0, t = _cuda_case("cosine", "simple", "eps", (8, 4, 16, 16))
    xt = ops.noise(x0, t, a, sg, seed=0, offset=0, out_dtype=torch.bfloat16)
    assert xt.dtype == torch.bfloat16
    pred = xt.detach().clone().requires_grad_()
    out = ops.loss(pred, x0, t, a, sg, w, torch.ones(8, device="cuda"), "eps", seed=0, offset=0)
    out.loss.backward()
    assert pred.grad.dtype == torch.bfloat16 and torch.isfinite(pred.grad.float()).all()
