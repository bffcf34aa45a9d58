"""Plain-PyTorch reference of the fused diffusion kernels (and the CPU backend).

Contracts (shapes: x0, pred, eps [B, ...]; t Long[B]; tables float [T]; iw float[B]):
  noise(x0, t, alpha, sigma, eps)                 x_t = alpha[t]·x0 + sigma[t]·eps (kernel A)
  loss(pred, x0, eps, t, alpha, sigma, w, iw, p)  per-sample d = pred - target(p); raw_b = mean(d²),
                                                  loss_b = w[t_b]·iw_b·raw_b  (kernel B, fp32 math)
  loss_and_grad(...)                              the same plus dL/dpred of L = mean_b loss_b
  scatter_stats(t, values, T)                     per-timestep [count, Σv, Σv² for each row of values]
  stream_noise(shape, seed, offset, device)       eps for (seed, offset) from torch's generator (the
                                                  torch backend's stream; Triton's Philox differs)
"""
from __future__ import annotations

import torch

from fasttrain.diffusion.prediction import target as _target


def _col(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather a [T] table at t and shape it [B, 1, ...] to broadcast over a sample."""
    return table.to(torch.float32)[t].view(-1, *([1] * (ndim - 1)))


def noise(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
          eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    a, s = _col(alpha, t, x0.ndim), _col(sigma, t, x0.ndim)
    x_t = a * x0.float() + s * eps.float()
    return x_t.to(out_dtype or x0.dtype)


def loss(pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor,
         alpha: torch.Tensor, sigma: torch.Tensor, weight: torch.Tensor, iw: torch.Tensor,
         prediction: str):
    """Returns (per-sample weighted loss ℓ_b, per-sample raw MSE); the batch loss is ℓ.mean()."""
    a, s = _col(alpha, t, x0.ndim), _col(sigma, t, x0.ndim)
    d = pred.float() - _target(prediction, x0.float(), eps.float(), a, s)
    raw = d.pow(2).flatten(1).mean(1)
    return weight.to(torch.float32)[t] * iw.float() * raw, raw


def loss_and_grad(pred, x0, eps, t, alpha, sigma, weight, iw, prediction):
    """(per-sample loss, raw MSE, dL/dpred) with L = mean_b loss_b: grad = 2·w[t_b]·iw_b·d/(B·D)."""
    a, s = _col(alpha, t, x0.ndim), _col(sigma, t, x0.ndim)
    d = pred.float() - _target(prediction, x0.float(), eps.float(), a, s)
    raw = d.pow(2).flatten(1).mean(1)
    wi = weight.to(torch.float32)[t] * iw.float()
    scale = (2.0 / d[0].numel() / d.shape[0]) * wi
    grad = d * scale.view(-1, *([1] * (d.ndim - 1)))
    return wi * raw, raw, grad.to(pred.dtype)


def _mix(seed: int, offset: int) -> int:
    """One 63-bit generator seed per (seed, offset) pair (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + offset) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def stream_noise(shape, seed: int, offset: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(_mix(seed, offset))
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32)


def scatter_stats(t: torch.Tensor, values: torch.Tensor, T: int) -> torch.Tensor:
    """values [R, B] → fp64 bins [1 + 2R, T]: count, then (Σ, Σ²) of each row, scattered by t."""
    v = values.detach().to(torch.float64)
    rows = [torch.ones_like(v[0])]
    for r in v:
        rows += [r, r * r]
    src = torch.stack(rows)
    return torch.zeros(src.shape[0], T, dtype=torch.float64, device=v.device).index_add_(1, t, src)
