"""The PyTorch reference math of the noise op and the diffusion loss op: the test oracle of every
other backend, and the `torch` backend itself (noise.py, diffusion_loss.py).

Contracts (x0, pred, eps [B, ...]; t Long[B]; tables float [T]; coef float [2, T]; iw float [B]):
  noise(x0, t, alpha, sigma, eps)            x_t = alpha[t]·x0 + sigma[t]·eps          (the noise op)
  target(x0, eps, t, coef)                   coef[0, t]·eps + coef[1, t]·x0: every linear prediction
                                             type (eps (1, 0), x0 (0, 1), v (a, -s), flow (1, -1))
  loss(pred, x0, eps, t, weight, iw, coef)   d = pred - target; raw_b = mean(d²) in fp32;
                                             ℓ_b = weight[t_b]·iw_b·raw_b                (the loss op)
  loss_and_grad(...)                         the same plus dL/dpred of L = mean_b ℓ_b
The noise is `philox.randn(shape, seed, offset)`, the stream the kernels draw in place.
"""
from __future__ import annotations

import torch


def column(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather a [T] table at t as float32 and shape it [B, 1, ...] to broadcast over a sample."""
    return table.to(torch.float32)[t].view(-1, *([1] * (ndim - 1)))


def noise(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
          eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    x_t = column(alpha, t, x0.ndim) * x0.float() + column(sigma, t, x0.ndim) * eps.float()
    return x_t.to(out_dtype or x0.dtype)


def target(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return column(coef[0], t, x0.ndim) * eps.float() + column(coef[1], t, x0.ndim) * x0.float()


def loss(pred, x0, eps, t, weight, iw, coef):
    """(per-sample weighted loss ℓ_b, per-sample raw MSE); the batch loss is ℓ.mean()."""
    d = pred.float() - target(x0, eps, t, coef)
    raw = d.pow(2).flatten(1).mean(1)
    return weight.to(torch.float32)[t] * iw.float() * raw, raw


def loss_and_grad(pred, x0, eps, t, weight, iw, coef):
    """(ℓ_b, raw_b, dL/dpred) with L = mean_b ℓ_b: grad = 2·w[t_b]·iw_b·d/(B·D), in pred's dtype."""
    d = pred.float() - target(x0, eps, t, coef)
    raw = d.pow(2).flatten(1).mean(1)
    wi = weight.to(torch.float32)[t] * iw.float()
    scale = (2.0 / d[0].numel() / d.shape[0]) * wi
    grad = d * scale.view(-1, *([1] * (d.ndim - 1)))
    return wi * raw, raw, grad.to(pred.dtype)
