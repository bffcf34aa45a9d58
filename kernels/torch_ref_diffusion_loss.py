"""The PyTorch reference math of the diffusion loss op (diffusion_loss.py): the test oracle of every other
backend, and the `torch` backend itself.

Contracts (x0, pred, eps [B, ...]; t Long[B]; tables float [T]; coef float [2, T]; iw float [B]):
  target(x0, eps, t, coef)                   coef[0, t]·eps + coef[1, t]·x0: every linear prediction
                                             type (eps (1, 0), x0 (0, 1), v (a, -s), flow (1, -1))
  loss(pred, x0, eps, t, weight, iw, coef)   d = pred - target; raw_b = mean(ρ(d)) in fp32 (ρ: the loss
                                             shape, loss_shape.py; d² by default, c = c_table[t_b]);
                                             ℓ_b = weight[t_b]·iw_b·raw_b
  loss_and_grad(...)                         the same plus dL/dpred of L = mean_b ℓ_b
  mask (optional, every function)            a per-pixel weight m [B, 1 or C, ...] (broadcast over the
                                             channels) multiplying ρ(d) before the per-sample mean:
                                             raw_b = mean(m·ρ(d)), the mean over ALL elements (not over
                                             Σm), as sd-scripts' apply_masked_loss
                                             (library/custom_train_functions.py: loss * mask, then
                                             train_network.py's mean over every dim but the batch);
                                             dL/dpred gets the same factor m
eps is the noise op's (torch_ref_noise.py: the plain stream, or `reference_eps` with noise options).
"""
from __future__ import annotations

import torch

from . import loss_shape
from .torch_ref_noise import column


def target(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return column(coef[0], t, x0.ndim) * eps.float() + column(coef[1], t, x0.ndim) * x0.float()


def threshold(c_table, t: torch.Tensor, ndim: int, kind: int):
    """The loss shape's c(t_b) as [B, 1, ...] float32, or None for shapes without one."""
    return column(c_table, t, ndim) if loss_shape.needs_c(kind) else None


def masked(r: torch.Tensor, mask) -> torch.Tensor:
    """r·m in float32 (m broadcast over the channels), or r itself without a mask."""
    return r if mask is None else r * mask.float()


def loss(pred, x0, eps, t, weight, iw, coef, kind: int = loss_shape.L2, c_table=None, mask=None):
    """(per-sample weighted loss ℓ_b, per-sample raw loss mean(m·ρ(d))); the batch loss is ℓ.mean()."""
    d = pred.float() - target(x0, eps, t, coef)
    raw = masked(loss_shape.rho(d, threshold(c_table, t, d.ndim, kind), kind), mask).flatten(1).mean(1)
    return weight.to(torch.float32)[t] * iw.float() * raw, raw


def loss_and_grad(pred, x0, eps, t, weight, iw, coef, kind: int = loss_shape.L2, c_table=None, mask=None):
    """(ℓ_b, raw_b, dL/dpred) with L = mean_b ℓ_b: grad = 2·w[t_b]·iw_b·m·ψ(d)/(B·D) (ψ = ρ'/2; d for l2;
    m = 1 without a mask), in pred's dtype."""
    d = pred.float() - target(x0, eps, t, coef)
    c = threshold(c_table, t, d.ndim, kind)
    raw = masked(loss_shape.rho(d, c, kind), mask).flatten(1).mean(1)
    wi = weight.to(torch.float32)[t] * iw.float()
    scale = (2.0 / d[0].numel() / d.shape[0]) * wi
    grad = masked(loss_shape.psi(d, c, kind), mask) * scale.view(-1, *([1] * (d.ndim - 1)))
    return wi * raw, raw, grad.to(pred.dtype)
