"""Per-element loss shapes ρ of the loss kernels, and their reference math (torch_ref_diffusion_loss.py,
torch_ref_mixed_loss.py use it; the Triton and C++ kernels compute the same operations).

With d the residual (pred - target) and c > 0 a threshold gathered per sample from a [T] table c(t):
  l2            ρ = d²                                  ψ = d
  l1            ρ = |d|                                 ψ = sign(d)/2
  huber         ρ = 2c·(√(d² + c²) − c)                 ψ = c·d/√(d² + c²)
  smooth_l1     ρ = 2·(√(d² + c²) − c)                  ψ = d/√(d² + c²)
  pseudo_huber  ρ = √(d² + c²) − c                      ψ = d/(2·√(d² + c²))
ψ = ρ'/2, so the gradient of the batch mean of ℓ_b = w·iw·mean(ρ(d)) is (2/(B·D))·w·iw·ψ(d), the l2
formula with d replaced by ψ(d).

Names: `huber` and `smooth_l1` are sd-scripts' (train_util.conditional_loss) and diffusers'
(research_projects/scheduled_huber_loss_training) — both pseudo-Huber forms, not torch's huber_loss
/ smooth_l1_loss; `pseudo_huber` is Charbonnier's form as diffusers' LCM distillation scripts use it
(√(d² + c²) − c, with c = 0.001 there). √(d² + c²) − c is computed as d²/(√(d² + c²) + c): the same
value, without the cancellation for |d| ≪ c.
"""
from __future__ import annotations

import torch

LOSSES = ("l2", "l1", "huber", "smooth_l1", "pseudo_huber")
L2, L1, HUBER, SMOOTH_L1, PSEUDO_HUBER = range(len(LOSSES))


def code(name: str) -> int:
    if name not in LOSSES:
        raise ValueError(f"unknown loss shape {name!r}; choose from {', '.join(LOSSES)}")
    return LOSSES.index(name)


def needs_c(kind: int) -> bool:
    """Whether the shape reads the threshold table c(t)."""
    return kind >= HUBER


def check_c(kind: int, c: torch.Tensor | None, T: int, device) -> None:
    if not needs_c(kind):
        return
    if c is None or c.numel() != T or c.dtype != torch.float32 or c.device != torch.device(device):
        raise ValueError(f"loss {LOSSES[kind]!r} needs its threshold table c(t): float32 [{T}] on {device}")


def _sqrt_term(d: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.sqrt(d * d + c * c)
    return q, (d * d) / (q + c)  # √(d² + c²) − c without cancellation


def rho(d: torch.Tensor, c: torch.Tensor | None, kind: int) -> torch.Tensor:
    """ρ(d) in float32 (c broadcasts against d); differentiable by autograd (c > 0)."""
    if kind == L2:
        return d * d
    if kind == L1:
        return d.abs()
    _, r = _sqrt_term(d, c)
    return {HUBER: (2 * c) * r, SMOOTH_L1: 2 * r, PSEUDO_HUBER: r}[kind]


def psi(d: torch.Tensor, c: torch.Tensor | None, kind: int) -> torch.Tensor:
    """ψ(d) = ρ'(d)/2 (l1: sign(d)/2, 0 at d = 0, as autograd of |d|)."""
    if kind == L2:
        return d
    if kind == L1:
        return 0.5 * torch.sign(d)
    q, _ = _sqrt_term(d, c)
    m = {HUBER: c, SMOOTH_L1: torch.ones_like(c), PSEUDO_HUBER: 0.5 * torch.ones_like(c)}[kind]
    return (m * d) / q
