"""The mixed-prediction loss as a custom op (`fasttrain::mixed_loss`), its autograd rule and backends.

Contract and formulas: mixed_reference.py. Backends as in ops.py: "triton" (CUDA), "native" (the
C++ CPU op fasttrain_C::mixed_loss, kernels/csrc/cpu/mixed.cpp), "interpret" (the Triton kernel in
the Triton interpreter on CPU tensors), "torch" (the reference), "auto". The
op mutates the statistics bins (V = 2 + H values: raw, weighted, each head's x0 error), so, as for
kernel B, the autograd rule is a `torch.autograd.Function` around the opaque op, and `register_fake`
lets a model compiled with `fullgraph=True` call it.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from . import mixed_reference as mref
from . import native, ops, philox
from .bins import TimestepBins, scatter_into

_WARNED_NATIVE_CUDA = False


def _native_on_cuda() -> None:
    """backend="native" with CUDA tensors: fasttrain._C has no CUDA mixed op (the Triton kernel is the
    GPU path), so the reference runs, as it did before the CPU op existed; said once per process."""
    global _WARNED_NATIVE_CUDA
    if not _WARNED_NATIVE_CUDA:
        _WARNED_NATIVE_CUDA = True
        warnings.warn("fasttrain: the native mixed loss is CPU only; on CUDA backend='native' runs the reference "
                      "(backend='auto' or 'triton' runs the fused Triton kernel)", stacklevel=2)


def _budget(backend: str, block: int) -> int:
    # Interpreter: few large programs (each op costs Python time); GPU: 2048-element tiles, as kernel B
    # (the tile spans heads × channels × pixels; not yet tuned on a GPU).
    return block or (16384 if backend == "interpret" else 2048)


@torch.library.custom_op("fasttrain::mixed_loss", mutates_args=("bins",))
def _mixed_op(out: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, iw: torch.Tensor,
              tab: torch.Tensor, gate: Optional[torch.Tensor], pivots: torch.Tensor, bins: torch.Tensor,
              eps: Optional[torch.Tensor], seed: int, offset: torch.Tensor, backend: str, block: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor]:
    B, T = x0.shape[0], weight.numel()
    H, C = tab.shape[0], x0.shape[1]
    if backend == "native":
        if out.device.type == "cpu":
            return native.mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset)
        _native_on_cuda()  # no CUDA version of the native op: the reference below, explicitly
    if backend in ("torch", "native"):
        e = eps if eps is not None else philox.randn(x0.shape, seed, offset, x0.device)
        per, raw, wl, x0e, grad, ggrad = mref.loss_and_grad(out, x0, e, t, weight, iw, tab, gate)
        if bins.numel():
            scatter_into(bins, pivots, t, torch.cat([raw[None], wl[None], x0e.T]))
        return per.mean(), per, raw, wl, x0e, grad, ggrad
    triton, tk = ops._triton()
    from . import triton_mixed as tm

    P = x0[0, 0].numel()
    HP, CB, BP = tm.tile(H, C, P, _budget(backend, block))
    nch = triton.cdiv(P, BP)
    nacc = 1 + 3 * HP
    acc, cnt = ops.workspace(B, out.device, nacc)
    f32 = dict(dtype=torch.float32, device=out.device)
    grad = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    ggrad = torch.empty((B, H) if gate is not None else (0,), dtype=gate.dtype if gate is not None else out.dtype,
                        device=out.device)
    raw, wl, per, mean = torch.empty(B, **f32), torch.empty(B, **f32), torch.empty(B, **f32), torch.empty((), **f32)
    x0e = torch.empty(B, H, **f32)
    x0c = x0.contiguous()
    tm.mixed_loss_kernel[(B, nch)](
        out.contiguous(), x0c, eps.contiguous() if eps is not None else x0c, t, weight, iw, tab.contiguous(),
        gate.contiguous() if gate is not None else iw, pivots, bins, grad, ggrad, acc, cnt, raw, wl, per, x0e,
        mean, H, C, P, out.shape[1], B, T, nch, nacc, seed, offset, 2.0 / (B * C * P),
        PIXEL_GATE=gate is None, HAS_EPS=eps is not None, BINS=bins.numel() > 0, NROWS=mref.NROWS,
        HP=HP, CB=CB, BP=BP)
    return mean, per, raw, wl, x0e, grad, ggrad


@_mixed_op.register_fake
def _(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, backend, block):
    B, H = x0.shape[0], tab.shape[0]
    f = dict(dtype=torch.float32, device=out.device)
    ggrad = (torch.empty((B, H), dtype=gate.dtype, device=out.device) if gate is not None
             else torch.empty((0,), dtype=out.dtype, device=out.device))
    return (torch.empty((), **f), torch.empty(B, **f), torch.empty(B, **f), torch.empty(B, **f),
            torch.empty((B, H), **f), torch.empty_like(out), ggrad)


class _MixedLoss(torch.autograd.Function):
    """The op wrote ∂(mean_b ℓ_b)/∂out and ∂/∂gate; backward rescales them by the upstream gradient
    (g_mean, plus B·g_b per sample where the caller rescales each ℓ_b, e.g. a learned weighting).
    raw, weighted and the per-head x0 errors are statistics and carry no gradient."""

    @staticmethod
    def forward(ctx, out, gate, *args):
        mean, per, raw, wl, x0e, grad, ggrad = _mixed_op(out, args[0], args[1], args[2], args[3], args[4], gate,
                                                         *args[5:])
        ctx.save_for_backward(grad, ggrad)
        ctx.has_gate = gate is not None
        ctx.mark_non_differentiable(raw, wl, x0e)
        ctx.set_materialize_grads(False)
        return mean, per, raw, wl, x0e

    @staticmethod
    def backward(ctx, g_mean, g_per, g_raw, g_wl, g_x0e):
        grad, ggrad = ctx.saved_tensors
        n_rest = 12
        if g_mean is None and g_per is None:
            return (None, None) + (None,) * n_rest
        if g_per is None:
            # as kernel B's rule: a bf16 gradient × the fp32 0-d upstream gradient stays bf16 and runs as
            # one kernel (the same rounding as the fp32 round trip below, a third of its memory traffic)
            return (grad * g_mean, ggrad * g_mean if ctx.has_gate else None) + (None,) * n_rest
        B = grad.shape[0]
        scale = B * g_per.float() if g_mean is None else g_mean.float() + B * g_per.float()

        def rescale(g):
            return (g.float() * scale.view(-1, *([1] * (g.ndim - 1)))).to(g.dtype)

        return (rescale(grad), rescale(ggrad) if ctx.has_gate else None) + (None,) * n_rest


class MixedLossOut(NamedTuple):
    loss: torch.Tensor         # 0-d: mean_b ℓ_b (differentiable)
    per_sample: torch.Tensor   # [B]: ℓ_b = iw_b·weighted_b (differentiable)
    raw: torch.Tensor          # [B]: mean((x̂0_mix - x0)²) (statistic)
    weighted: torch.Tensor     # [B]: w[t_b]·raw_b + Σ_i aux_i[t_b]·own-space MSE_i (statistic)
    x0_error: torch.Tensor     # [B, H]: mean((x̂0_i - x0)²) per head (statistic)


def mixed_loss(out, x0, t, weight, iw, tab, *, gate=None, seed: int = 0, offset=0, eps=None,
               bins: TimestepBins | None = None, backend: str = "auto", block: int = 0) -> MixedLossOut:
    """The mixed-prediction loss (mixed_reference.py): `out` [B, H·C (+ H: pixel gate), *S], `tab`
    [H, NROWS, T] (built by fasttrain.diffusion.mixed), `weight` the x0-space weight [T], `gate` [B, H]
    per-sample logits (the timestep gate) or None (pixel gate in `out`). With `bins` (2 + H values)
    the per-sample values are scattered into them. `block` overrides the tile budget (tests)."""
    backend = ops.resolve_backend(backend, out.device)
    H, _ = mref.check_shapes(out, x0, tab, gate)
    if bins is not None and bins.n_values != 2 + H:
        raise ValueError(f"the mixed loss scatters 2 + H = {2 + H} values (raw, weighted, each head's x0 "
                         f"error); these bins hold {bins.n_values}")
    data = bins.data if bins is not None else out.new_empty((0, 0), dtype=torch.float64)
    piv = bins.pivots if bins is not None else out.new_empty((0, 0), dtype=torch.float64)
    return MixedLossOut(*_MixedLoss.apply(out, gate, x0, t, weight, iw, tab, piv, data, eps,
                                          philox.check_seed(seed), ops._offset(offset, out.device), backend, block))
