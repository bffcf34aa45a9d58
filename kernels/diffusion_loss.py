"""The diffusion loss op: per-sample ℓ_b = w[t_b]·iw_b·mean((pred - target)²) for the target
coef[0, t]·eps + coef[1, t]·x0, its gradient written in the forward pass, the raw and weighted losses
scattered into the per-timestep bins (contract: torch_ref_diffusion_loss.py).

`fasttrain::diffusion_loss` is an opaque `torch.library.custom_op` with `register_fake`. It mutates
the statistics bins, so its autograd rule is a `torch.autograd.Function` around the op
(`register_autograd` accepts functional ops only); a model compiled with `fullgraph=True` can call it.
Backends (backend.py): the Triton loss kernel (triton_diffusion_loss.py), the native C++/CUDA op
(native.py), the PyTorch reference (torch_ref_diffusion_loss.py). eps is regenerated from the stream the noise op drew
(philox.py; with the step's noise options, noise_spec.py), unless given. The loss shape (loss_shape.py:
l2, l1 and the Huber family with a threshold table c(t)) is per element, inside the same pass, and so
is the optional per-pixel weight (`mask`: sd-scripts' masked loss, torch_ref_diffusion_loss.py).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import loss_shape, native, noise_spec, philox, torch_ref_noise
from . import torch_ref_diffusion_loss as ref
from .backend import as_offset, resolve_backend
from .bins import TimestepBins, scatter_into
from .noise_spec import NoiseSpec

NEEDS_EPS, NEEDS_X0 = 1, 2  # bits of `needs`: which inputs the target reads


@torch.library.custom_op("fasttrain::diffusion_loss", mutates_args=("bins",))
def _loss_op(pred: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, iw: torch.Tensor,
             coef: torch.Tensor, pivots: torch.Tensor, bins: torch.Tensor, eps: Optional[torch.Tensor], seed: int,
             offset: torch.Tensor, needs: int, spec_i: list[int], table: Optional[torch.Tensor],
             rows: Optional[torch.Tensor], mean: Optional[torch.Tensor], std: Optional[torch.Tensor], kind: int,
             c_table: Optional[torch.Tensor], backend: str, block: int,
             mask: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "native":
        return native.loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs, spec_i, table, rows,
                           mean, std, kind, c_table, mask)
    spec = NoiseSpec(tuple(spec_i), table, rows, mean, std) if spec_i else None
    if backend == "torch":
        e = eps if eps is not None else torch_ref_noise.reference_eps(spec, x0.shape, seed, offset, x0.device)
        per, raw, grad = ref.loss_and_grad(pred, x0, e, t, weight, iw, coef, kind, c_table, mask)
        wl = weight.float()[t] * raw
        if bins.numel():
            scatter_into(bins, pivots, t, torch.stack([raw, wl]))
        return per.mean(), per, raw, wl, grad
    from . import triton_diffusion_loss  # imports triton: only now, after resolve_backend (backend.py)

    return triton_diffusion_loss.loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset,
                                      bool(needs & NEEDS_EPS), bool(needs & NEEDS_X0), spec, kind, c_table,
                                      backend == "interpret", block, mask)


@_loss_op.register_fake
def _(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs, spec_i, table, rows, mean, std, kind,
      c_table, backend, block, mask=None):
    B = pred.shape[0]
    f = dict(dtype=torch.float32, device=pred.device)
    return torch.empty((), **f), torch.empty(B, **f), torch.empty(B, **f), torch.empty(B, **f), torch.empty_like(pred)


class _Loss(torch.autograd.Function):
    """Autograd rule of the loss op. The op already wrote ∂(mean_b ℓ_b)/∂pred, so backward is one
    scale by the upstream gradient (one launch). ∂ℓ_b/∂pred_b is B times that, so a per-sample
    upstream gradient g_b (e.g. a learned weighting that rescales each ℓ_b) contributes B·g_b. The
    raw and weighted MSEs are statistics and carry no gradient, nor does the per-pixel weight."""

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
            return (None if g_mean is None else grad * g_mean,) + (None,) * _NARGS
        B = grad.shape[0]
        scale = B * g_per.float() if g_mean is None else g_mean.float() + B * g_per.float()
        g = grad.float() * scale.view(-1, *([1] * (grad.ndim - 1)))
        return (g.to(grad.dtype),) + (None,) * _NARGS


_NARGS = 21  # the op's arguments after pred


class LossOut(NamedTuple):
    loss: torch.Tensor         # 0-d: mean_b ℓ_b (differentiable)
    per_sample: torch.Tensor   # [B]: ℓ_b = w[t_b]·iw_b·mean(m·ρ(d)) (differentiable; m = 1 without a mask)
    raw: torch.Tensor          # [B]: mean(m·ρ(d)) in the prediction's space (ρ = d²: the MSE) (statistic)
    weighted: torch.Tensor     # [B]: w[t_b]·mean(m·ρ(d)), without the importance weight (statistic)


def needs_of(coef_is_used: tuple[bool, bool]) -> int:
    """The `needs` bits from (target uses eps, target uses x0), known on the host per prediction type."""
    return (NEEDS_EPS if coef_is_used[0] else 0) | (NEEDS_X0 if coef_is_used[1] else 0)


def check_mask(mask: torch.Tensor | None, pred: torch.Tensor) -> None:
    """A per-pixel weight is [B, 1 or C, *pred's other dims] (broadcast over the channels, or one per
    element), float32/bf16/fp16, contiguous, on pred's device; ValueError naming what it got otherwise."""
    if mask is None:
        return
    ok_shape = (mask.ndim == pred.ndim and pred.ndim >= 2 and mask.shape[0] == pred.shape[0]
                and mask.shape[1] in (1, pred.shape[1]) and mask.shape[2:] == pred.shape[2:])
    if not ok_shape:
        raise ValueError(f"the per-pixel weight (mask) must be [B, 1 or C, ...] of the prediction's "
                         f"{list(pred.shape)}, got {list(mask.shape)}")
    if mask.dtype not in (torch.float32, torch.bfloat16, torch.float16) or mask.device != pred.device:
        raise ValueError(f"the per-pixel weight (mask) must be float32/bf16/fp16 on {pred.device}, got {mask.dtype} "
                         f"on {mask.device}")


def diffusion_loss(pred, x0, t, weight, iw, coef, *, uses=(True, True), seed: int = 0, offset: int = 0, eps=None,
                   spec: NoiseSpec | None = None, loss: str = "l2", c_table: torch.Tensor | None = None,
                   bins: TimestepBins | None = None, backend: str = "auto", block: int = 0,
                   mask: torch.Tensor | None = None) -> LossOut:
    """The loss for the target coef[0, t]·eps + coef[1, t]·x0 (`uses`: whether each term is nonzero
    for this prediction type, so the kernel can skip a read). With `bins` (2 values: raw, weighted)
    the per-sample losses are also scattered into them. seed/offset/spec: the noise op's; `loss` the
    shape ρ (loss_shape.LOSSES) and `c_table` its threshold c(t), float32 [T]; `eps` given overrides the
    stream (tests, probes; not with a spec); `block` overrides the Triton tile (tests). `mask`: a
    per-pixel weight m [B, 1 or C, ...] (check_mask) multiplying ρ(d) and its gradient elementwise
    before the per-sample mean over all D elements (sd-scripts' masked loss: torch_ref_diffusion_loss.py);
    None is the unweighted loss, the same kernels as without the argument."""
    backend = resolve_backend(backend, pred.device)
    check_mask(mask, pred)
    kind = loss_shape.code(loss)
    loss_shape.check_c(kind, c_table, weight.numel(), pred.device)
    if spec is not None and eps is not None:
        raise ValueError("give either eps or a noise spec, not both")
    noise_spec.check(spec, x0.shape, x0.device)
    if bins is not None and bins.n_values != 2:
        raise ValueError(f"the loss kernel scatters 2 values (raw, weighted); these bins hold {bins.n_values}")
    data = bins.data if bins is not None else pred.new_empty((0, 0), dtype=torch.float64)
    piv = bins.pivots if bins is not None else pred.new_empty((0, 0), dtype=torch.float64)
    return LossOut(*_Loss.apply(pred, x0, t, weight, iw, coef, piv, data, eps, philox.check_seed(seed),
                                as_offset(offset, pred.device), needs_of(uses), *noise_spec.op_args(spec), kind,
                                c_table if loss_shape.needs_c(kind) else None, backend, block,
                                None if mask is None else mask.contiguous()))
