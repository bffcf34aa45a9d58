"""Benchmark cases for the per-step diffusion math (the noise op and the diffusion loss op), shared by
bench_diffusion_loss.py and the smoke test: the PyTorch reference math eagerly and under
torch.compile, and the fused ops (Triton, native C++/CUDA), forward + backward.

One "step" of diffusion math: x_t from x0 (noise), then, for a model output `pred` that requires
grad, the loss, dL/dpred and the per-timestep statistics. The model itself is left out: these
benchmarks time what fasttrain fuses. The unfused baselines draw eps with torch's generator and keep
it in memory between the two halves, as a plain PyTorch trainer does; the fused ops draw it from
the Philox stream in both kernels and never store it.
Byte floor (performance notes §1.5): x0 read twice, x_t written, pred read, grad written:
2·s_x + 3·s_m bytes per element (14 with fp32 x0 and a bf16 model).
"""
from __future__ import annotations

import os
import platform
import time

import _env  # noqa: F401  (OpenMP's wait policy, before torch loads it)
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, native, torch_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise

# latent-dit: DiT-B/2's and DiT-XL/2's batch of 256 px images as SD-VAE latents (4x32x32), 14.7 MB at the
# byte floor, which an H100's or H200's 50-60 MB L2 holds; latent-512: the same at 512 px; pixel: 176 MB,
# several times the L2, so that its figure is HBM's
SHAPES = {"latent-dit": (256, 4, 32, 32), "latent-512": (256, 4, 64, 64), "pixel": (64, 3, 256, 256)}


def impls(device, interpret: bool = False) -> list[str]:
    """What runs on `device`: the torch baselines, and each fused backend available there (on CPU
    the Triton interpreter is a correctness tool, ~1000x slower, and is left out unless `interpret`:
    the GPU check's dry run calls the Triton path that way on tiny shapes)."""
    device = torch.device(device)
    out = ["eager", "compile_ref"]
    if device.type == "cuda" or interpret:
        out.append("triton")
    if native.available(device):
        out.append("native")
    return out


class Case:
    def __init__(self, shape, device, pred_type="v", model_dtype=torch.bfloat16, seed=0):
        self.device = torch.device(device)
        s = fd.schedule("linear", T=1000)
        self.a = s.alpha.float().to(device)
        self.s = s.sigma.float().to(device)
        self.w = fd.loss_weight("min_snr", s, prediction=pred_type).float().to(device)
        self.coef = P.get(pred_type).table(s.alpha, s.sigma).to(device)
        self.uses = P.get(pred_type).uses
        g = torch.Generator(device).manual_seed(seed)
        self.x0 = torch.rand(shape, generator=g, device=device) * 2 - 1
        self.t = torch.randint(0, 1000, (shape[0],), generator=g, device=device)
        self.iw = torch.ones(shape[0], device=device)
        self.pred = (torch.randn(shape, generator=g, device=device) * 0.5).to(model_dtype).requires_grad_()
        self.model_dtype = model_dtype
        self.bins = TimestepBins(1000, 2, device)
        self.offset = torch.zeros((), dtype=torch.int64, device=device)
        self.compiled = None

    @property
    def floor_bytes(self) -> int:
        n = self.x0.numel()
        return n * (2 * self.x0.element_size() + 3 * self.pred.element_size())

    # -- the implementations ---------------------------------------------------------------------
    def _reference(self, x0, t, iw, pred):
        eps = torch.randn_like(x0)
        x_t = torch_ref.noise(x0, t, self.a, self.s, eps, self.model_dtype)
        per, raw = torch_ref.loss(pred, x0, eps, t, self.w, iw, self.coef)
        return x_t, per.mean(), raw

    @property
    def backward_bytes(self) -> int:
        """What the fused ops' backward moves: the gradient their forward wrote, read and scaled by the
        upstream gradient, and written (diffusion_loss.py, `_Loss.backward`)."""
        return 2 * self.pred.numel() * self.pred.element_size()

    def _scatter(self, raw):
        raw = raw.detach()
        self.bins.scatter_(self.t, torch.stack([raw, self.w[self.t] * raw]))

    # each implementation: the step's diffusion math, forward (noise, loss, statistics) and, unless
    # backward=False, the backward into pred.grad
    def eager(self, backward=True):
        self.pred.grad = None
        x_t, loss, raw = self._reference(self.x0, self.t, self.iw, self.pred)
        if backward:
            loss.backward()
        self._scatter(raw)
        return loss

    def compile_ref(self, backward=True):
        if self.compiled is None:
            self.compiled = torch.compile(self._reference, dynamic=False)  # one static graph per shape
        self.pred.grad = None
        x_t, loss, raw = self.compiled(self.x0, self.t, self.iw, self.pred)
        if backward:
            loss.backward()
        self._scatter(raw)
        return loss

    def fused(self, backend="auto", backward=True):
        self.pred.grad = None
        noise(self.x0, self.t, self.a, self.s, seed=1, offset=self.offset, out_dtype=self.model_dtype,
              backend=backend)
        loss = diffusion_loss(self.pred, self.x0, self.t, self.w, self.iw, self.coef, uses=self.uses, seed=1,
                              offset=self.offset, bins=self.bins, backend=backend).loss
        if backward:
            loss.backward()
        return loss

    def triton(self, backward=True):
        # on CPU the interpreter runs the same kernels (impls(interpret=True): a check, not a timing)
        return self.fused("triton" if self.device.type == "cuda" else "interpret", backward)

    def native(self, backward=True):
        return self.fused("native", backward)


def count_launches(fn) -> int:
    """CUDA kernels launched by one call (profiler), or on CPU the number of aten ops dispatched."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm (compile, autotune)
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if (e.name.startswith("aten::") or e.name.startswith("fasttrain"))
               and e.cpu_parent is None)


def ceilings(device) -> dict:
    """The device's own ceilings, measured in the same run as the figures set against them: the copy
    bandwidth (a device-to-device copy, bytes read + written; 2 GiB on CUDA) and the dense bf16 matrix
    product rate (8192^3 on CUDA), each the best of 10 timed calls after 3 warm-ups. On CPU tiny sizes,
    fp32: the code path, not a ceiling worth quoting."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n, k, dt = (2**29, 8192, torch.bfloat16) if cuda else (2**16, 64, torch.float32)

    def best(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    def copy_time() -> float:  # its buffers freed before the matrix product
        src, dst = torch.rand(n, device=device), torch.empty(n, device=device)
        return best(lambda: dst.copy_(src))

    def matmul_time() -> float:
        a, b = (torch.randn(k, k, device=device).to(dt) for _ in range(2))
        return best(lambda: a @ b)

    copy_s, mm_s = copy_time(), matmul_time()
    return {"device": device.type, "copy_bytes": 2 * 4 * n, "copy_GBps": 2 * 4 * n / copy_s / 1e9,
            "matmul": f"{k}x{k}x{k} {str(dt).removeprefix('torch.')}", "matmul_TFLOPs": 2 * k**3 / mm_s / 1e12}


def machine() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "loadavg_1min": round(os.getloadavg()[0], 2)}  # other processes on a shared machine
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if native.available("cpu"):
        info["native_cpu_kernels"] = torch.ops.fasttrain_C.cpu_capability()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
