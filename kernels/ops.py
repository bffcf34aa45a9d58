"""torch.library custom ops around the diffusion kernels, and backend selection.

Backends: "triton" (compiled kernels on CUDA tensors), "native" (the C++/CUDA ops of `fasttrain._C`,
see native.py), "interpret" (the Triton kernels in the Triton interpreter on CPU tensors: tests),
"torch" (the reference), "auto" (triton on CUDA, native on CPU where it is built, else torch).
Triton is imported only when a Triton backend is first used, so choosing the interpreter is
explicit: `interpret` (or TRITON_INTERPRET=1 in the environment) before anything imports triton.

Every launch sits inside an opaque `custom_op` with `register_fake`; the loss op mutates the
statistics bins, so the autograd rules are `torch.autograd.Function`s around the ops
(`register_autograd` accepts functional ops only). A model compiled with `fullgraph=True` can call
them (a raw Triton launch, or `triton_op`, cannot be traced under the interpreter).
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple, Optional

import torch

from . import native, philox
from . import reference as ref
from .bins import TimestepBins, scatter_into

BACKENDS = ("auto", "triton", "native", "interpret", "torch")
NEEDS_EPS, NEEDS_X0 = 1, 2  # bits of `needs`: which inputs the target reads


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _triton():
    """(triton, the kernel module), imported on first use."""
    import triton

    from . import triton_kernels

    return triton, triton_kernels


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for tensors on `device`; a one-line error when it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and _has_triton():
            return "triton"
        return "native" if native.available(device) else "torch"
    if backend == "triton" and (device.type != "cuda" or not _has_triton()):
        raise ValueError("backend 'triton' needs CUDA tensors and triton; use 'interpret' on CPU")
    if backend == "native" and not native.available(device):
        raise ValueError(f"backend 'native' is not available for {device.type} tensors: {native.why_not(device)}")
    if backend == "interpret":
        if not _has_triton():
            raise ValueError("backend 'interpret' needs triton installed")
        if device.type != "cpu":
            raise ValueError("backend 'interpret' runs on CPU tensors")
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"  # must precede the import (triton jits tl.rand at import)
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend 'interpret' must be chosen before triton is imported "
                             "(set TRITON_INTERPRET=1 in the environment)")
    return backend


def _block(D: int, backend: str, block: int) -> int:
    if block:
        return block
    triton, _ = _triton()
    # Interpreter: few large programs (each costs ~0.5 ms of Python); GPU: 2048-element tiles.
    return min(16384 if backend == "interpret" else 2048, max(16, triton.next_power_of_2(D)))


_WORKSPACES: dict = {}


def workspace(B: int, device: torch.device, width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss kernel's accumulators: [(B + 1)·width] fp32 sums and [B + 1] int32 tile counters, per
    (device, stream, B, width). Zeroed once here; every launch of a loss kernel leaves them zeroed
    again (triton_kernels.py, triton_mixed.py), so there is no memset launch and no call order."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, B, width)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros((B + 1) * width, dtype=torch.float32, device=device),
                            torch.zeros(B + 1, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


# -- kernel A ------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::noise", mutates_args=())
def _noise_op(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
              eps: Optional[torch.Tensor], seed: int, offset: torch.Tensor, out_dtype: torch.dtype,
              write_eps: bool, backend: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "native":
        return native.noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps)
    if backend == "torch":
        e = eps.float() if eps is not None else philox.randn(x0.shape, seed, offset, x0.device)
        eps_out = e.clone() if write_eps else x0.new_empty(0, dtype=torch.float32)
        return ref.noise(x0, t, alpha, sigma, e, out_dtype), eps_out
    triton, tk = _triton()
    B, D = x0.shape[0], x0[0].numel()
    x0c = x0.contiguous()
    xt = torch.empty(x0.shape, dtype=out_dtype, device=x0.device)
    eps_out = torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device)
    BLOCK = _block(D, backend, block)
    tk.noise_kernel[(B, triton.cdiv(D, BLOCK))](x0c, t, alpha, sigma, eps.contiguous() if eps is not None else x0c,
                                                xt, eps_out, D, seed, offset, HAS_EPS=eps is not None,
                                                WRITE_EPS=write_eps, BLOCK=BLOCK)
    return xt, eps_out


@_noise_op.register_fake
def _(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, backend, block):
    return (torch.empty(x0.shape, dtype=out_dtype, device=x0.device),
            torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device))


class _Noise(torch.autograd.Function):
    """Autograd rule of kernel A: ∂x_t/∂x0 = alpha[t]."""

    @staticmethod
    def forward(ctx, x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, backend, block):
        xt, e = _noise_op(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, backend, block)
        ctx.save_for_backward(t, alpha)
        ctx.x0_dtype = x0.dtype
        ctx.mark_non_differentiable(e)
        return xt, e

    @staticmethod
    def backward(ctx, g_xt, g_eps):
        t, alpha = ctx.saved_tensors
        return (ref.column(alpha, t, g_xt.ndim) * g_xt.float()).to(ctx.x0_dtype), *([None] * 10)


# -- kernel B ------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::diffusion_loss", mutates_args=("bins",))
def _loss_op(pred: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, iw: torch.Tensor,
             coef: torch.Tensor, pivots: torch.Tensor, bins: torch.Tensor, eps: Optional[torch.Tensor], seed: int,
             offset: torch.Tensor, needs: int, backend: str, block: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "native":
        return native.loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs)
    B, D, T = pred.shape[0], pred[0].numel(), weight.numel()
    if backend == "torch":
        e = eps if eps is not None else philox.randn(x0.shape, seed, offset, x0.device)
        per, raw, grad = ref.loss_and_grad(pred, x0, e, t, weight, iw, coef)
        wl = weight.float()[t] * raw
        if bins.numel():
            scatter_into(bins, pivots, t, torch.stack([raw, wl]))
        return per.mean(), per, raw, wl, grad
    triton, tk = _triton()
    BLOCK = _block(D, backend, block)
    nch = triton.cdiv(D, BLOCK)
    acc, cnt = workspace(B, pred.device)
    grad = torch.empty_like(pred, memory_format=torch.contiguous_format)
    f32 = dict(dtype=torch.float32, device=pred.device)
    raw, wl, per, mean = torch.empty(B, **f32), torch.empty(B, **f32), torch.empty(B, **f32), torch.empty((), **f32)
    x0c = x0.contiguous()
    tk.loss_kernel[(B, nch)](pred.contiguous(), x0c, eps.contiguous() if eps is not None else x0c, t, weight, iw,
                             coef, pivots, bins, grad, acc, cnt, raw, wl, per, mean, D, B, T, nch, seed, offset,
                             2.0 / (B * D), NEEDS_EPS=bool(needs & NEEDS_EPS), NEEDS_X0=bool(needs & NEEDS_X0),
                             HAS_EPS=eps is not None, BINS=bins.numel() > 0, BLOCK=BLOCK)
    return mean, per, raw, wl, grad


@_loss_op.register_fake
def _(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs, backend, block):
    B = pred.shape[0]
    f = dict(dtype=torch.float32, device=pred.device)
    return torch.empty((), **f), torch.empty(B, **f), torch.empty(B, **f), torch.empty(B, **f), torch.empty_like(pred)


class _Loss(torch.autograd.Function):
    """Autograd rule of kernel B. The kernel already wrote ∂(mean_b ℓ_b)/∂pred, so backward is one
    scale by the upstream gradient (one launch). ∂ℓ_b/∂pred_b is B times that, so a per-sample
    upstream gradient g_b (e.g. a learned weighting that rescales each ℓ_b) contributes B·g_b. The
    raw and weighted MSEs are statistics and carry no gradient."""

    @staticmethod
    def forward(ctx, pred, *args):
        mean, per, raw, wl, grad = _loss_op(pred, *args)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(raw, wl)
        ctx.set_materialize_grads(False)  # unused outputs give None, not zero-filled tensors
        return mean, per, raw, wl

    @staticmethod
    def backward(ctx, g_mean, g_per, g_raw, g_wl):
        (grad,) = ctx.saved_tensors
        if g_per is None:
            # bf16 grad × fp32 0-d tensor stays bf16 and runs as a single kernel
            return (None if g_mean is None else grad * g_mean,) + (None,) * 13
        B = grad.shape[0]
        scale = B * g_per.float() if g_mean is None else g_mean.float() + B * g_per.float()
        g = grad.float() * scale.view(-1, *([1] * (grad.ndim - 1)))
        return (g.to(grad.dtype),) + (None,) * 13


# -- public API ----------------------------------------------------------------------------------
def _offset(offset, device) -> torch.Tensor:
    """The noise counter offset as an int64 0-d tensor on the data's device (the kernels read it there,
    so a captured graph can advance it in place)."""
    if isinstance(offset, torch.Tensor):
        return offset.reshape(())
    return torch.tensor(int(offset), dtype=torch.int64, device=device)


def noise(x0, t, alpha, sigma, *, seed: int = 0, offset: int = 0, eps=None, out_dtype=None,
          return_eps: bool = False, backend: str = "auto", block: int = 0):
    """Kernel A: x_t (and the eps it used when `return_eps`). Tables are float32 [T] on x0's device."""
    backend = resolve_backend(backend, x0.device)
    xt, e = _Noise.apply(x0, t, alpha, sigma, eps, philox.check_seed(seed), _offset(offset, x0.device),
                         out_dtype or x0.dtype, return_eps, backend, block)
    return (xt, e) if return_eps else xt


class LossOut(NamedTuple):
    loss: torch.Tensor         # 0-d: mean_b ℓ_b (differentiable)
    per_sample: torch.Tensor   # [B]: ℓ_b = w[t_b]·iw_b·mean(d²) (differentiable)
    raw: torch.Tensor          # [B]: mean(d²) in the prediction's space (statistic)
    weighted: torch.Tensor     # [B]: w[t_b]·mean(d²), without the importance weight (statistic)


def needs_of(coef_is_used: tuple[bool, bool]) -> int:
    """The `needs` bits from (target uses eps, target uses x0), known on the host per prediction type."""
    return (NEEDS_EPS if coef_is_used[0] else 0) | (NEEDS_X0 if coef_is_used[1] else 0)


def loss(pred, x0, t, weight, iw, coef, *, uses=(True, True), seed: int = 0, offset: int = 0, eps=None,
         bins: TimestepBins | None = None, backend: str = "auto", block: int = 0) -> LossOut:
    """Kernel B for the target coef[0, t]·eps + coef[1, t]·x0 (`uses`: whether each term is nonzero
    for this prediction type, so the kernel can skip a read). With `bins` (2 values: raw, weighted)
    the per-sample losses are also scattered into them."""
    backend = resolve_backend(backend, pred.device)
    if bins is not None and bins.n_values != 2:
        raise ValueError(f"the loss kernel scatters 2 values (raw, weighted); these bins hold {bins.n_values}")
    data = bins.data if bins is not None else pred.new_empty((0, 0), dtype=torch.float64)
    piv = bins.pivots if bins is not None else pred.new_empty((0, 0), dtype=torch.float64)
    return LossOut(*_Loss.apply(pred, x0, t, weight, iw, coef, piv, data, eps, philox.check_seed(seed),
                                _offset(offset, pred.device), needs_of(uses), backend, block))
