"""DiffusionObjective: schedule × prediction × weighting × sampler × stats → one training loss.

    loss, info = objective(model, x0, cond)

One step (DESIGN.md, "One training step"): t, iw ~ sampler; kernel A: x_t = alpha[t]·x0 +
sigma[t]·eps with eps from the counter-based stream (seed, offset); pred = model(x_t, t, cond);
kernel B: per-sample ℓ_b = w[t_b]·iw_b·mean((pred - target)²) with the same eps, the gradient written
in the forward pass, and the raw and weighted losses scattered into the TimestepStats window.
Nothing here syncs with the host. The kernels come from `fasttrain.kernels.ops` (Triton on CUDA, the
PyTorch reference on CPU, the Triton interpreter on request); the semantics are the same, only the
noise stream differs (Philox in Triton, torch's generator in the reference).
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.kernels import ops
from fasttrain.kernels import reference as ref

from . import prediction as P
from .samplers import TimestepSampler, timestep_sampler
from .schedule import NoiseSchedule
from .stats import TimestepStats
from .weighting import LearnedLogVarWeight, effective_x0_weight, loss_weight

BACKENDS = ops.BACKENDS


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
        self.backend = backend  # resolved per call against the data's device
        if isinstance(weighting, str):
            self.weighting_name = weighting
            weighting = loss_weight(weighting, schedule, prediction, **(weighting_args or {}))
        else:
            self.weighting_name = "custom"
        # fp32 copies of the tables: what the kernels gather by t
        self.register_buffer("weight", weighting.to(torch.float32), persistent=False)
        self.register_buffer("weight64", weighting.to(torch.float64), persistent=False)  # for plots
        self.register_buffer("alpha", schedule.alpha.float(), persistent=False)
        self.register_buffer("sigma", schedule.sigma.float(), persistent=False)
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
        """The torch backend's eps for the next (seed, offset); the offset advances by numel."""
        eps = ref.stream_noise(like.shape, self.seed, self.offset, like.device)
        self.offset += like.numel()
        return eps

    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None):
        B = x0.shape[0]
        if t is None:
            t, iw = self.sampler.sample(B, generator)
        else:
            iw = torch.ones(B, device=x0.device)
        backend = ops.resolve_backend(self.backend, x0.device)
        seed, offset = self.seed, self.offset
        self.offset += x0.numel()
        ws = ops.new_workspace(B, x0.device)  # zeroed by kernel A, used by kernel B
        x_t = ops.noise(x0, t, self.alpha, self.sigma, seed=seed, offset=offset, workspace=ws, backend=backend)
        pred = model(x_t, t) if cond is None else model(x_t, t, cond)
        st = self.stats
        loss, per_sample, raw, weighted = ops.loss(pred, x0, t, self.alpha, self.sigma, self.weight, iw, self.prediction,
                                         seed=seed, offset=offset, workspace=ws, backend=backend,
                                         bins=st.pending if st is not None else None,
                                         pivots=st.pivots() if st is not None else None)
        if st is not None:
            st.record(t, weighted)
        if self.learned is not None:
            per_sample = self.learned(t, per_sample)
            loss = per_sample.mean()
        info = {"t": t, "iw": iw, "raw": raw.detach(), "weighted": weighted.detach(),
                "loss_per_sample": per_sample.detach()}
        return loss, info

    # -- views for plots and logs ----------------------------------------------------------------
    def probs(self) -> torch.Tensor:
        return self.sampler.probs()

    def effective_weight(self, probs: torch.Tensor | None = None) -> torch.Tensor:
        """T·p(t)·iw(t)·w(t)·c(t): the x0-space weight of each timestep in this objective."""
        p = self.probs() if probs is None else probs
        iw = None if self.sampler.biased else 1.0 / (self.T * p)
        return effective_x0_weight(self.weight64, self.schedule, self.prediction, p, iw)

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
