"""Loss variation across timesteps: Xie & Agam's diagnosis (arXiv 2502.01990) made measurable.

The paper attributes small-batch training failures to the large variation of the training loss
across timesteps: an update driven by one t-region disrupts the others. Two numbers measure it, for
every prediction type (mixed or not):

  loss_cv       coefficient of variation (population std / mean) across timestep buckets of the
                per-bucket mean weighted loss, from the running statistics (TimestepStats): how unequal
                the timesteps' contributions to the objective are.
  grad_norm_cv  the same across buckets of ‖∇θ L_bucket‖ on a fixed probe batch with fixed noise
                (common random numbers, so two calls differ only by the model): how unequal the
                timesteps' pulls on the parameters are. Costs one forward/backward per bucket, so the
                trainer calls it every K steps.

The cross-timestep interference matrix (how a step on one bucket changes the loss of another) needs
the look-ahead around the optimizer step: interference.py.
"""
from __future__ import annotations

import torch

from fasttrain.kernels import philox

from .stats import TimestepStats


def coefficient_of_variation(values: torch.Tensor) -> torch.Tensor:
    """std/mean (population std) over the finite entries; NaN with fewer than two or a zero mean."""
    v = values.double().flatten()
    ok = torch.isfinite(v)
    n = ok.sum()
    mean = torch.where(ok, v, 0.0).sum() / n.clamp_min(1)
    var = torch.where(ok, (v - mean) ** 2, 0.0).sum() / n.clamp_min(1)
    return torch.where((n >= 2) & (mean != 0), var.sqrt() / mean.abs(), torch.nan)


def loss_cv(stats: TimestepStats, n_buckets: int = 10, kind: str = "weighted") -> torch.Tensor:
    """CV across `n_buckets` equal-width timestep buckets of the per-bucket mean of `kind` (the running
    totals; buckets never seen are left out). 0-d float64 tensor, no host sync."""
    return coefficient_of_variation(stats.bucketed(n_buckets, kind)["mean"])


def bucket_timesteps(T: int, n_buckets: int, per_bucket: int, device="cpu") -> torch.Tensor:
    """Long[n_buckets, per_bucket]: for each equal-width bucket, the midpoints of `per_bucket` equal
    strata of it (deterministic, so probes are comparable across calls)."""
    edges = torch.linspace(0, T, n_buckets + 1, dtype=torch.float64)
    u = (torch.arange(per_bucket, dtype=torch.float64) + 0.5) / per_bucket
    t = edges[:-1, None] + (edges[1:] - edges[:-1])[:, None] * u[None, :]
    return t.floor().long().clamp(0, T - 1).to(device)


def probe_noise(x0: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The probe's fixed eps: the project's noise stream at (seed, offset 0)."""
    return philox.randn(x0.shape, seed, 0, x0.device)


def bucket_grad_norms(objective, model, x0: torch.Tensor, cond=None, n_buckets: int = 10,
                      eps: torch.Tensor | None = None, params=None) -> torch.Tensor:
    """[n_buckets] float64: ‖∇θ mean_b ℓ_b‖ with every probe sample at the bucket's stratified t
    (`objective.probe_loss`: no statistics, no noise-counter move; parameters' .grad untouched)."""
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    eps = probe_noise(x0) if eps is None else eps
    ts = bucket_timesteps(objective.T, n_buckets, x0.shape[0], x0.device)
    norms = []
    for t in ts:
        loss = objective.probe_loss(model, x0, t, eps, cond).mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    return torch.stack(norms)


def grad_norm_cv(objective, model, x0: torch.Tensor, cond=None, n_buckets: int = 10,
                 eps: torch.Tensor | None = None, params=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(CV, per-bucket gradient norms) on the probe batch x0 (see `bucket_grad_norms`)."""
    norms = bucket_grad_norms(objective, model, x0, cond, n_buckets, eps, params)
    return coefficient_of_variation(norms), norms
