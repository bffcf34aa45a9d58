"""The mixed-prediction loss op (`fasttrain::mixed_loss`), its autograd rule and backends.

Contract and formulas: torch_ref_mixed_loss.py. Backends (backend.py): "triton" (the kernel of
triton_mixed_loss.py on CUDA), "native" (the C++ CPU op fasttrain_C::mixed_loss,
kernels/csrc/cpu/mixed.cpp), "interpret" (the Triton kernel in the Triton interpreter on CPU tensors),
"torch" (the PyTorch reference math), "auto". The op mutates the statistics bins (V = 2 + H values:
raw, weighted, each head's x0 error), so, as for the diffusion loss op (diffusion_loss.py), the
autograd rule is a `torch.autograd.Function` around the opaque op, and `register_fake` lets a model
compiled with `fullgraph=True` call it.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from . import loss_shape, native, noise_spec, philox, torch_ref_noise
from . import torch_ref_mixed_loss as ref
from .backend import as_offset, resolve_backend
from .bins import TimestepBins, scatter_into
from .noise_spec import NoiseSpec

_WARNED_NATIVE_CUDA = False


def _native_on_cuda() -> None:
    """backend="native" with CUDA tensors: fasttrain._C has no CUDA mixed op (the Triton kernel is the
    GPU path), so the reference runs, as it did before the CPU op existed; said once per process."""
    global _WARNED_NATIVE_CUDA
    if not _WARNED_NATIVE_CUDA:
        _WARNED_NATIVE_CUDA = True
        warnings.warn("fasttrain: the native mixed loss is CPU only; on CUDA backend='native' runs the reference "
                      "(backend='auto' or 'triton' runs the fused Triton kernel)", stacklevel=2)


@torch.library.custom_op("fasttrain::mixed_loss", mutates_args=("bins",))
def _mixed_op(out: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, iw: torch.Tensor,
              tab: torch.Tensor, gate: Optional[torch.Tensor], pivots: torch.Tensor, bins: torch.Tensor,
              eps: Optional[torch.Tensor], seed: int, offset: torch.Tensor, spec_i: list[int],
              table: Optional[torch.Tensor], rows: Optional[torch.Tensor], mean: Optional[torch.Tensor],
              std: Optional[torch.Tensor], kind: int, c_table: Optional[torch.Tensor], backend: str, block: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor]:
    if backend == "native":
        if out.device.type == "cpu":
            return native.mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, spec_i, table,
                                     rows, mean, std, kind, c_table)
        _native_on_cuda()  # no CUDA version of the native op: the reference below, explicitly
    spec = NoiseSpec(tuple(spec_i), table, rows, mean, std) if spec_i else None
    if backend in ("torch", "native"):
        e = eps if eps is not None else torch_ref_noise.reference_eps(spec, x0.shape, seed, offset, x0.device)
        per, raw, wl, x0e, grad, ggrad = ref.loss_and_grad(out, x0, e, t, weight, iw, tab, gate, kind, c_table)
        if bins.numel():
            scatter_into(bins, pivots, t, torch.cat([raw[None], wl[None], x0e.T]))
        return per.mean(), per, raw, wl, x0e, grad, ggrad
    from . import triton_mixed_loss  # imports triton: only now, after resolve_backend (backend.py)

    return triton_mixed_loss.mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, spec,
                                        kind, c_table, ref.NROWS, backend == "interpret", block)


@_mixed_op.register_fake
def _(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, spec_i, table, rows, mean, std, kind,
      c_table, backend, block):
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
        n_rest = 19  # the op's arguments after out and gate
        if g_mean is None and g_per is None:
            return (None, None) + (None,) * n_rest
        if g_per is None:
            # as the diffusion loss op's rule: a bf16 gradient × the fp32 0-d upstream gradient stays bf16 and
            # runs as one kernel (the same rounding as the fp32 round trip below, a third of its memory traffic)
            return (grad * g_mean, ggrad * g_mean if ctx.has_gate else None) + (None,) * n_rest
        B = grad.shape[0]
        scale = B * g_per.float() if g_mean is None else g_mean.float() + B * g_per.float()

        def rescale(g):
            return (g.float() * scale.view(-1, *([1] * (g.ndim - 1)))).to(g.dtype)

        return (rescale(grad), rescale(ggrad) if ctx.has_gate else None) + (None,) * n_rest


class MixedLossOut(NamedTuple):
    loss: torch.Tensor         # 0-d: mean_b ℓ_b (differentiable)
    per_sample: torch.Tensor   # [B]: ℓ_b = iw_b·weighted_b (differentiable)
    raw: torch.Tensor          # [B]: mean(ρ(x̂0_mix - x0)) (ρ = d²: the x0-space MSE) (statistic)
    weighted: torch.Tensor     # [B]: w[t_b]·raw_b + Σ_i aux_i[t_b]·mean(ρ(own-space residual_i)) (statistic)
    x0_error: torch.Tensor     # [B, H]: mean((x̂0_i - x0)²) per head (statistic)


def mixed_loss(out, x0, t, weight, iw, tab, *, gate=None, seed: int = 0, offset=0, eps=None,
               spec: NoiseSpec | None = None, loss: str = "l2", c_table: torch.Tensor | None = None,
               bins: TimestepBins | None = None, backend: str = "auto", block: int = 0) -> MixedLossOut:
    """The mixed-prediction loss (torch_ref_mixed_loss.py): `out` [B, H·C (+ H: pixel gate), *S], `tab`
    [H, NROWS, T] (built by fasttrain.diffusion.mixed), `weight` the x0-space weight [T], `gate` [B, H]
    per-sample logits (the timestep gate) or None (pixel gate in `out`). With `bins` (2 + H values)
    the per-sample values are scattered into them. `spec`: the noise op's options; `loss`/`c_table`: the
    loss shape of the main and the aux terms (loss_shape.py). `block` overrides the tile budget (tests)."""
    backend = resolve_backend(backend, out.device)
    H, _ = ref.check_shapes(out, x0, tab, gate)
    kind = loss_shape.code(loss)
    loss_shape.check_c(kind, c_table, weight.numel(), out.device)
    if spec is not None and eps is not None:
        raise ValueError("give either eps or a noise spec, not both")
    noise_spec.check(spec, x0.shape, x0.device)
    if bins is not None and bins.n_values != 2 + H:
        raise ValueError(f"the mixed loss scatters 2 + H = {2 + H} values (raw, weighted, each head's x0 "
                         f"error); these bins hold {bins.n_values}")
    data = bins.data if bins is not None else out.new_empty((0, 0), dtype=torch.float64)
    piv = bins.pivots if bins is not None else out.new_empty((0, 0), dtype=torch.float64)
    return MixedLossOut(*_MixedLoss.apply(out, gate, x0, t, weight, iw, tab, piv, data, eps,
                                          philox.check_seed(seed), as_offset(offset, out.device),
                                          *noise_spec.op_args(spec), kind,
                                          c_table if loss_shape.needs_c(kind) else None, backend, block))
