"""Shared by the kernel tests: which backends run here, and the inputs of the noise and diffusion loss
tests (tables, data, pre-filled bins), never zeros. The mixed loss's inputs: mixed_harness.py.

Backends, as the ops name them (kernels/backend.py): "torch" (the PyTorch reference math, on CUDA where
there is a GPU), the Triton kernels ("triton" on CUDA, else "interpret": the Triton interpreter on CPU
tensors), and "native" (the C++ CPU ops of fasttrain._C, on CPU tensors everywhere; their CUDA ops:
test_gpu.py)."""
from typing import NamedTuple

import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, native
from fasttrain.kernels.backend import has_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" if torch.cuda.is_available() else "interpret"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
ULP = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # as rtol: one rounding of the dtype


class Backend(NamedTuple):
    name: str    # the ops' `backend` argument
    device: str  # where its tensors live


def device_of(name: str) -> str:
    return "cpu" if name in ("native", "interpret") else DEVICE


def cpu_sets() -> list[str]:
    """The CPU kernel sets of fasttrain._C this processor runs (each a separately compiled copy)."""
    best = torch.ops.fasttrain_C.cpu_capability()
    return ["default", "avx2", "avx512"][: ["default", "avx2", "avx512"].index(best) + 1]


def backends(*names: str, every_cpu_set: bool = False):
    """Parametrise a test over `names` ("torch", "triton": compiled on CUDA, the interpreter on CPU,
    "native"), through the `backend` fixture (conftest.py). A backend that cannot run here is a
    skipped parameter with the reason. `every_cpu_set`: native once per CPU kernel set."""
    params = []
    for name in names:
        if name == "triton":
            no_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
            params.append(pytest.param(TRITON, marks=no_triton))
        elif name == "native" and not native.available("cpu"):
            params.append(pytest.param("native", marks=pytest.mark.skip(reason="fasttrain._C is not built")))
        elif name == "native" and every_cpu_set:
            params += [pytest.param(f"native/{s}", id=f"native-{s}") for s in cpu_sets()]
        else:
            params.append(name)
    return pytest.mark.parametrize("backend", params, indirect=True)


def rounds_like_torch(be: Backend) -> bool:
    """The reference itself, and the native ops (no FMA contraction, torch's float conversions:
    CMakeLists.txt, csrc/cpu/convert.h), give the reference's x_t bit for bit; the Triton kernels'
    fp32 → bf16/fp16 casts need not round like torch's (one ulp)."""
    return be.name in ("torch", "native")


def assert_same(got: torch.Tensor, want: torch.Tensor, be: Backend):
    """Bit for bit where the backend rounds like torch, else to one rounding of the dtype (fp32: exact)."""
    assert got.dtype == want.dtype
    if rounds_like_torch(be):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=ULP[got.dtype], atol=0)


def tables(sched="linear", pred="eps", weighting="min_snr", T=1000, device=DEVICE):
    s = fd.schedule(sched, T=T)
    w = fd.loss_weight(weighting, s, prediction=pred)
    coef = P.get(pred).table(s.alpha, s.sigma).to(device)
    return s.alpha.float().to(device), s.sigma.float().to(device), w.float().to(device), coef


def inputs(shape, dtype=torch.float32, seed=0, T=1000, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype).to(device)
    eps = torch.randn(shape, generator=g).to(device)
    t = torch.randint(0, T, (shape[0],), generator=g).to(device)
    t[: (shape[0] + 1) // 2] = 7  # many samples on one timestep
    iw = (torch.rand(shape[0], generator=g) + 0.5).to(device)
    return x0, eps, t, iw


def filled_bins(T=1000, seed=3, device=DEVICE):
    """Bins that already hold values (the scatter accumulates) and non-zero pivots."""
    g = torch.Generator().manual_seed(seed)
    b = TimestepBins(T, 2, device)
    b.data = torch.randn(5, T, dtype=torch.float64, generator=g).to(device)
    b.pivots = (torch.randn(2, T, dtype=torch.float64, generator=g) * 0.1).to(device)
    return b
