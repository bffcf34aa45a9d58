"""Prediction types: what the network outputs, its regression target, and conversions.

With x_t = a·x0 + s·eps (a = alpha[t], s = sigma[t]):
  eps  target eps
  x0   target x0
  v    target a·eps - s·x0                (Salimans & Ho 2022)
  flow target eps - x0                    (rectified-flow velocity)

`c(t)` turns an x0-space MSE into this type's MSE for a fixed x_t (research notes §0):
  ‖pred - target‖² = c(t)·‖x̂0 - x0‖²,  c = SNR (eps), 1 (x0), (a²+s²)²/s² (v; = SNR+1 for VP),
  (a+s)²/s² (flow; = 1/s² on the rectified-flow grid).
"""
from __future__ import annotations

import torch

PREDICTIONS = ("eps", "x0", "v", "flow")
# Integer codes shared with the kernels.
CODE = {p: i for i, p in enumerate(PREDICTIONS)}


def check(prediction: str) -> str:
    if prediction not in PREDICTIONS:
        raise ValueError(f"unknown prediction {prediction!r}; choose from {', '.join(PREDICTIONS)}")
    return prediction


def target(prediction: str, x0: torch.Tensor, eps: torch.Tensor, a, s) -> torch.Tensor:
    """Regression target; `a`, `s` broadcast against x0 (per-sample columns or scalars)."""
    if prediction == "eps":
        return eps
    if prediction == "x0":
        return x0
    if prediction == "v":
        return a * eps - s * x0
    if prediction == "flow":
        return eps - x0
    raise ValueError(f"unknown prediction {prediction!r}")


def to_x0_eps(prediction: str, pred: torch.Tensor, x_t: torch.Tensor, a, s, eps_alpha_min: float = 1e-8):
    """Convert a network output to (x̂0, ε̂). `a` may be 0 at a zero-terminal step: the eps branch
    then divides by max(a, eps_alpha_min), as samplers never use x̂0 from pure noise with eps-pred."""
    if prediction == "eps":
        e = pred
        x0 = (x_t - s * e) / torch.clamp(torch.as_tensor(a, dtype=x_t.dtype, device=x_t.device), min=eps_alpha_min)
    elif prediction == "x0":
        x0 = pred
        e = (x_t - a * x0) / s
    elif prediction == "v":
        # [x_t; v] = [[a, s], [-s, a]]·[x0; eps] with determinant r = a² + s² (1 for VP).
        r = a * a + s * s
        x0 = (a * x_t - s * pred) / r
        e = (s * x_t + a * pred) / r
    elif prediction == "flow":
        # x_t = (a + s)·x0 + s·u with u = eps - x0.
        x0 = (x_t - s * pred) / (a + s)
        e = pred + x0
    else:
        raise ValueError(f"unknown prediction {prediction!r}")
    return x0, e


def from_x0_eps(prediction: str, x0: torch.Tensor, eps: torch.Tensor, a, s) -> torch.Tensor:
    """The prediction that corresponds to given (x0, eps): identical to `target`."""
    return target(prediction, x0, eps, a, s)


def c_factor(prediction: str, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """c(t) per timestep (float64 tables in, [T] out); see the module docstring."""
    check(prediction)
    if prediction == "eps":
        return alpha**2 / sigma**2
    if prediction == "x0":
        return torch.ones_like(alpha)
    if prediction == "v":
        return (alpha**2 + sigma**2) ** 2 / sigma**2
    return (alpha + sigma) ** 2 / sigma**2
