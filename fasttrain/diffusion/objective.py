"""DiffusionObjective: schedule × prediction × weighting × sampler × stats → one training loss.

    loss, info = objective(model, x0, cond)

One step (DESIGN.md, "One training step"): t, iw ~ sampler; eps from the counter-based stream
(seed, offset); x_t = alpha[t]·x0 + sigma[t]·eps; pred = model(x_t, t, cond); per-sample
ℓ_b = w[t_b]·iw_b·mean((pred - target)²); the raw and weighted losses go into TimestepStats bins.
Nothing here syncs with the host.
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.kernels import reference as ref

from . import prediction as P
from .samplers import TimestepSampler, timestep_sampler
from .schedule import NoiseSchedule
from .stats import TimestepStats
from .weighting import LearnedLogVarWeight, effective_x0_weight, loss_weight

BACKENDS = ("auto", "torch")


def _mix(seed: int, offset: int) -> int:
    """One 63-bit generator seed per (seed, offset) pair (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + offset) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class DiffusionObjective(nn.Module):
    def __init__(self, schedule: NoiseSchedule, prediction: str = "eps", weighting="simple",
                 sampler="uniform", *, weighting_args: dict | None = None, sampler_args: dict | None = None,
                 stats: TimestepStats | bool = True, learned_weighting: bool = False,
                 backend: str = "auto", seed: int = 0):
        super().__init__()
        self.schedule = schedule
        self.prediction = P.check(prediction)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.backend = "torch" if backend == "auto" else backend
        if isinstance(weighting, str):
            self.weighting_name = weighting
            weighting = loss_weight(weighting, schedule, prediction, **(weighting_args or {}))
        else:
            self.weighting_name = "custom"
        self.register_buffer("weight", weighting.to(torch.float64), persistent=False)
        self.register_buffer("alpha", schedule.alpha.clone(), persistent=False)
        self.register_buffer("sigma", schedule.sigma.clone(), persistent=False)
        self.sampler: TimestepSampler = (timestep_sampler(sampler, schedule, **(sampler_args or {}))
                                         if isinstance(sampler, str) else sampler)
        if stats is True:
            history = getattr(self.sampler, "history", 0)
            stats = TimestepStats(schedule.T, schedule.device, history=history)
        self.stats: TimestepStats | None = stats or None
        self.learned = LearnedLogVarWeight(schedule) if learned_weighting else None
        self.seed, self.offset = int(seed), 0

    def _apply(self, fn, recurse=True):
        # Keep the non-module pieces (sampler, stats, schedule) on the same device as the buffers.
        out = super()._apply(fn, recurse)
        dev = self.alpha.device
        self.schedule = self.schedule.to(dev)
        self.sampler.to(dev)
        if self.stats is not None and self.stats.device != dev:
            state = self.stats.state_dict()
            self.stats.device = dev
            self.stats.load_state_dict(state)
        return out

    @property
    def T(self) -> int:
        return self.schedule.T

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """eps for this step from the (seed, offset) stream; the offset advances by numel."""
        g = torch.Generator(device=like.device).manual_seed(_mix(self.seed, self.offset))
        self.offset += like.numel()
        return torch.randn(like.shape, generator=g, device=like.device, dtype=torch.float32)

    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None):
        B = x0.shape[0]
        if t is None:
            t, iw = self.sampler.sample(B, generator)
        else:
            iw = torch.ones(B, device=x0.device)
        eps = self.noise(x0)
        x_t = ref.noise(x0, t, self.alpha, self.sigma, eps)
        pred = model(x_t, t) if cond is None else model(x_t, t, cond)
        per_sample, raw = ref.loss(pred, x0, eps, t, self.alpha, self.sigma, self.weight, iw, self.prediction)
        weighted = self.weight.to(torch.float32)[t] * raw  # w·mse without the importance weight
        if self.learned is not None:
            per_sample = self.learned(t, per_sample)
        if self.stats is not None:
            self.stats.update(t, raw.detach(), weighted.detach())
        info = {"t": t, "iw": iw, "raw": raw.detach(), "weighted": weighted.detach(),
                "loss_per_sample": per_sample.detach()}
        return per_sample.mean(), info

    # -- views for plots and logs ----------------------------------------------------------------
    def probs(self) -> torch.Tensor:
        return self.sampler.probs()

    def effective_weight(self, probs: torch.Tensor | None = None) -> torch.Tensor:
        """T·p(t)·iw(t)·w(t)·c(t): the x0-space weight of each timestep in this objective."""
        p = self.probs() if probs is None else probs
        iw = None if self.sampler.biased else 1.0 / (self.T * p)
        return effective_x0_weight(self.weight, self.schedule, self.prediction, p, iw)

    def sync_stats(self) -> None:
        """All-reduce the statistics and let the sampler learn from them (every K steps)."""
        if self.stats is not None:
            self.stats.all_reduce()
            self.sampler.update(self.stats)

    def extra_state(self) -> dict:
        return {"seed": self.seed, "offset": self.offset, "sampler": self.sampler.state_dict(),
                "stats": self.stats.state_dict() if self.stats is not None else None}

    def load_extra_state(self, state: dict) -> None:
        self.seed, self.offset = int(state["seed"]), int(state["offset"])
        self.sampler.load_state_dict(state["sampler"])
        if self.stats is not None and state["stats"] is not None:
            self.stats.load_state_dict(state["stats"])
