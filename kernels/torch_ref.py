"""The PyTorch reference math of the noise op and the diffusion loss op: the test oracle of every
other backend, and the `torch` backend itself (noise.py, diffusion_loss.py).

Contracts (x0, pred, eps [B, ...]; t Long[B]; tables float [T]; coef float [2, T]; iw float [B]):
  noise(x0, t, alpha, sigma, eps)            x_t = alpha[t]·x0 + sigma[t]·eps          (the noise op)
  target(x0, eps, t, coef)                   coef[0, t]·eps + coef[1, t]·x0: every linear prediction
                                             type (eps (1, 0), x0 (0, 1), v (a, -s), flow (1, -1))
  loss(pred, x0, eps, t, weight, iw, coef)   d = pred - target; raw_b = mean(ρ(d)) in fp32 (ρ: the loss
                                             shape, loss_shape.py; d² by default, c = c_table[t_b]);
                                             ℓ_b = weight[t_b]·iw_b·raw_b                (the loss op)
  loss_and_grad(...)                         the same plus dL/dpred of L = mean_b ℓ_b
The noise is `philox.randn(shape, seed, offset)`, the stream the kernels draw in place, or with noise
options the ε of noise_spec.reference_eps.
"""
from __future__ import annotations

import torch

from . import loss_shape


def column(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather a [T] table at t as float32 and shape it [B, 1, ...] to broadcast over a sample."""
    return table.to(torch.float32)[t].view(-1, *([1] * (ndim - 1)))


def noise(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
          eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    x_t = column(alpha, t, x0.ndim) * x0.float() + column(sigma, t, x0.ndim) * eps.float()
    return x_t.to(out_dtype or x0.dtype)


def target(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return column(coef[0], t, x0.ndim) * eps.float() + column(coef[1], t, x0.ndim) * x0.float()


def threshold(c_table, t: torch.Tensor, ndim: int, kind: int):
    """The loss shape's c(t_b) as [B, 1, ...] float32, or None for shapes without one."""
    return column(c_table, t, ndim) if loss_shape.needs_c(kind) else None


def loss(pred, x0, eps, t, weight, iw, coef, kind: int = loss_shape.L2, c_table=None):
    """(per-sample weighted loss ℓ_b, per-sample raw loss mean(ρ(d))); the batch loss is ℓ.mean()."""
    d = pred.float() - target(x0, eps, t, coef)
    raw = loss_shape.rho(d, threshold(c_table, t, d.ndim, kind), kind).flatten(1).mean(1)
    return weight.to(torch.float32)[t] * iw.float() * raw, raw


def loss_and_grad(pred, x0, eps, t, weight, iw, coef, kind: int = loss_shape.L2, c_table=None):
    """(ℓ_b, raw_b, dL/dpred) with L = mean_b ℓ_b: grad = 2·w[t_b]·iw_b·ψ(d)/(B·D) (ψ = ρ'/2; d for l2),
    in pred's dtype."""
    d = pred.float() - target(x0, eps, t, coef)
    c = threshold(c_table, t, d.ndim, kind)
    raw = loss_shape.rho(d, c, kind).flatten(1).mean(1)
    wi = weight.to(torch.float32)[t] * iw.float()
    scale = (2.0 / d[0].numel() / d.shape[0]) * wi
    grad = loss_shape.psi(d, c, kind) * scale.view(-1, *([1] * (d.ndim - 1)))
    return wi * raw, raw, grad.to(pred.dtype)
