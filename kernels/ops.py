"""torch.library custom ops around the diffusion kernels, and backend selection.

Backends: "triton" (compiled kernels on CUDA tensors), "interpret" (the same kernels in the Triton
interpreter on CPU tensors: tests; TRITON_INTERPRET=1 must be set before triton is imported, which
`fasttrain/__init__.py` does on machines without CUDA), "torch" (the reference), "auto" (triton on
CUDA, torch otherwise). Every launch sits inside an opaque `custom_op` with `register_fake`; the
ops mutate their workspace and the statistics bins, so their autograd rules are
`torch.autograd.Function`s around them (`register_autograd` accepts functional ops only). A model
compiled with `fullgraph=True` can call them (a raw Triton launch, or
`triton_op`, cannot be traced under the interpreter: research notes §4).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from fasttrain.diffusion.prediction import CODE, PREDICTIONS

from . import reference as ref

try:
    import triton

    from . import triton_kernels as tk

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency of CUDA torch builds on Linux
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "interpret", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for tensors on `device`; a one-line error when it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if backend == "triton" and (device.type != "cuda" or not HAS_TRITON):
        raise ValueError("backend 'triton' needs CUDA tensors and triton; use 'interpret' on CPU")
    if backend == "interpret":
        if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend 'interpret' needs triton with TRITON_INTERPRET=1 set before triton is imported")
        if device.type != "cpu":
            raise ValueError("backend 'interpret' runs on CPU tensors")
    return backend


def _block(D: int, backend: str, block: int) -> int:
    if block:
        return block
    # Interpreter: few large programs (each costs ~0.5 ms of Python); GPU: 2048-element tiles.
    return min(16384 if backend == "interpret" else 2048, max(16, triton.next_power_of_2(D)))


def new_workspace(B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel B's accumulators: fp32 [B + 1] (Σd² per sample, then the batch loss) and int32 [B + 1]
    (finished tiles per sample, then finished samples). Kernel A zeroes them."""
    return (torch.empty(B + 1, dtype=torch.float32, device=device),
            torch.empty(B + 1, dtype=torch.int32, device=device))


# -- kernel A ------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::noise", mutates_args=("workspace", "counter"))
def _noise_op(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
              eps: Optional[torch.Tensor], seed: int, offset: int, out_dtype: torch.dtype,
              workspace: torch.Tensor, counter: torch.Tensor, write_eps: bool, backend: str,
              block: int) -> tuple[torch.Tensor, torch.Tensor]:
    B = x0.shape[0]
    D = x0[0].numel()
    if backend == "torch":
        e = eps if eps is not None else ref.stream_noise(x0.shape, seed, offset, x0.device)
        workspace.zero_()
        counter.zero_()
        eps_out = e.float().clone() if write_eps else x0.new_empty(0, dtype=torch.float32)
        return ref.noise(x0, t, alpha, sigma, e, out_dtype), eps_out
    x0c = x0.contiguous()
    xt = torch.empty(x0.shape, dtype=out_dtype, device=x0.device)
    eps_out = torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device)
    BLOCK = _block(D, backend, block)
    grid = (B, triton.cdiv(D, BLOCK))
    tk.noise_kernel[grid](x0c, t, alpha, sigma, eps.contiguous() if eps is not None else x0c, xt, eps_out,
                          workspace, counter, D, B, seed, offset, HAS_EPS=eps is not None, WRITE_EPS=write_eps,
                          ZERO_WS=workspace.numel() > 0, BLOCK=BLOCK)
    return xt, eps_out


@_noise_op.register_fake
def _(x0, t, alpha, sigma, eps, seed, offset, out_dtype, workspace, counter, write_eps, backend, block):
    return (torch.empty(x0.shape, dtype=out_dtype, device=x0.device),
            torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device))


class _Noise(torch.autograd.Function):
    """Autograd rule of kernel A (the op mutates its workspace, so it cannot carry `register_autograd`):
    ∂x_t/∂x0 = alpha[t]."""

    @staticmethod
    def forward(ctx, x0, t, alpha, sigma, eps, seed, offset, out_dtype, ws, cnt, write_eps, backend, block):
        xt, e = _noise_op(x0, t, alpha, sigma, eps, seed, offset, out_dtype, ws, cnt, write_eps, backend, block)
        ctx.save_for_backward(t, alpha)
        ctx.x0_dtype = x0.dtype
        ctx.mark_non_differentiable(e)
        return xt, e

    @staticmethod
    def backward(ctx, g_xt, g_eps):
        t, alpha = ctx.saved_tensors
        g = g_xt.float() * alpha.float()[t].view(-1, *([1] * (g_xt.ndim - 1)))
        return (g.to(ctx.x0_dtype),) + (None,) * 12


# -- kernel B ------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::diffusion_loss", mutates_args=("workspace", "counter", "bins"))
def _loss_op(pred: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
             weight: torch.Tensor, iw: torch.Tensor, pivots: torch.Tensor, bins: torch.Tensor,
             eps: Optional[torch.Tensor], seed: int, offset: int, prediction: int, workspace: torch.Tensor,
             counter: torch.Tensor, backend: str, block: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, D, T = pred.shape[0], pred[0].numel(), alpha.numel()
    if backend == "torch":
        e = eps if eps is not None else ref.stream_noise(x0.shape, seed, offset, x0.device)
        per, raw, grad = ref.loss_and_grad(pred, x0, e, t, alpha, sigma, weight, iw, PREDICTIONS[prediction])
        wl = weight.float()[t] * raw
        if bins.numel():
            bins += ref.scatter_stats(t, torch.stack([raw, wl]).double() - pivots[:, t], T)
        return per.mean(), per, raw, wl, grad
    BLOCK = _block(D, backend, block)
    nch = triton.cdiv(D, BLOCK)
    grad = torch.empty_like(pred, memory_format=torch.contiguous_format)
    raw = torch.empty(B, dtype=torch.float32, device=pred.device)
    wl = torch.empty(B, dtype=torch.float32, device=pred.device)
    per = torch.empty(B, dtype=torch.float32, device=pred.device)
    mean = torch.empty((), dtype=torch.float32, device=pred.device)
    x0c = x0.contiguous()
    tk.loss_kernel[(B, nch)](pred.contiguous(), x0c, eps.contiguous() if eps is not None else x0c, t, alpha, sigma,
                             weight, iw, pivots, grad, workspace, counter, raw, wl, per, mean, bins, D, B, T, nch, seed, offset,
                             2.0 / (B * D), PRED=prediction, HAS_EPS=eps is not None, BINS=bins.numel() > 0, BLOCK=BLOCK)
    return mean, per, raw, wl, grad


@_loss_op.register_fake
def _(pred, x0, t, alpha, sigma, weight, iw, pivots, bins, eps, seed, offset, prediction, workspace, counter, backend, block):
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
            return (None if g_mean is None else grad * g_mean,) + (None,) * 16
        B = grad.shape[0]
        scale = B * g_per.float() if g_mean is None else g_mean.float() + B * g_per.float()
        g = grad.float() * scale.view(-1, *([1] * (grad.ndim - 1)))
        return (g.to(grad.dtype),) + (None,) * 16


# -- standalone scatter --------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::scatter_stats", mutates_args=("bins",))
def _scatter_op(t: torch.Tensor, raw: torch.Tensor, weighted: torch.Tensor, pivots: torch.Tensor,
                bins: torch.Tensor, backend: str) -> None:
    T = bins.shape[1]
    if backend == "torch":
        bins += ref.scatter_stats(t, torch.stack([raw, weighted]).double() - pivots[:, t], T)
        return
    BLOCK = 1024
    tk.scatter_kernel[(triton.cdiv(t.numel(), BLOCK),)](t, raw.contiguous(), weighted.contiguous(), pivots, bins,
                                                         t.numel(), T, BLOCK=BLOCK)


@_scatter_op.register_fake
def _(t, raw, weighted, pivots, bins, backend):
    return None


# -- public API ----------------------------------------------------------------------------------
def noise(x0, t, alpha, sigma, *, seed: int = 0, offset: int = 0, eps=None, out_dtype=None, workspace=None,
          return_eps: bool = False, backend: str = "auto", block: int = 0):
    """Kernel A: x_t (and the eps it used when `return_eps`). Tables are float32 [T] on x0's device.
    `workspace` (from `new_workspace`) is zeroed for a following `loss` call."""
    backend = resolve_backend(backend, x0.device)
    ws, cnt = workspace if workspace is not None else (x0.new_empty(0), x0.new_empty(0, dtype=torch.int32))
    xt, e = _Noise.apply(x0, t, alpha, sigma, eps, int(seed), int(offset), out_dtype or x0.dtype, ws, cnt,
                         return_eps, backend, block)
    return (xt, e) if return_eps else xt


class LossOut(NamedTuple):
    loss: torch.Tensor         # 0-d: mean_b ℓ_b (differentiable)
    per_sample: torch.Tensor   # [B]: ℓ_b = w[t_b]·iw_b·mean(d²) (differentiable)
    raw: torch.Tensor          # [B]: mean(d²) in the prediction's space (statistic)
    weighted: torch.Tensor     # [B]: w[t_b]·mean(d²), without the importance weight (statistic)


def loss(pred, x0, t, alpha, sigma, weight, iw, prediction: str, *, seed: int = 0, offset: int = 0, eps=None,
         bins=None, pivots=None, workspace=None, backend: str = "auto", block: int = 0) -> LossOut:
    """Kernel B. With `bins` ([5, T] fp64) and `pivots` ([2, T] fp64) the raw and weighted losses are
    also scattered into the bins.
    `workspace` must come zeroed from `noise` (or pass None to allocate a zeroed one)."""
    if prediction not in CODE:
        raise ValueError(f"unknown prediction {prediction!r}; choose from {', '.join(PREDICTIONS)}")
    backend = resolve_backend(backend, pred.device)
    B = pred.shape[0]
    if workspace is None:
        workspace = (torch.zeros(B + 1, dtype=torch.float32, device=pred.device),
                     torch.zeros(B + 1, dtype=torch.int32, device=pred.device))
    if bins is None:
        bins, pivots = pred.new_empty((0, 0), dtype=torch.float64), pred.new_empty((0, 0), dtype=torch.float64)
    return LossOut(*_Loss.apply(pred, x0, t, alpha, sigma, weight, iw, pivots, bins, eps, int(seed), int(offset),
                                CODE[prediction], workspace[0], workspace[1], backend, block))


def scatter_stats(t, raw, weighted, pivots, bins, backend: str = "auto") -> None:
    """Add per-sample (raw, weighted) losses into [5, T] fp64 bins, shifted by [2, T] pivots."""
    _scatter_op(t, raw.float(), weighted.float(), pivots, bins, resolve_backend(backend, t.device))
