"""DiffusionObjective: schedule × prediction × weighting × sampler × stats → one training loss.

    loss, info = objective(model, x0, cond)

One step (docs/architecture.md): t, iw ~ sampler; the noise kernel: x_t = alpha[t]·x0 + sigma[t]·eps
with eps from the counter-based stream (seed, offset); pred = model(x_t, t, cond); the loss kernel:
per-sample ℓ_b = w[t_b]·iw_b·mean((pred - target)²) with the same eps, the gradient written in the
forward pass, and the raw and weighted losses scattered into the TimestepStats window. Nothing here
syncs with the host: the noise offset is a device counter advanced in place. With a learned weighting
the network also returns its per-timestep log-variance u(t) (EDM2), and ℓ_b becomes ℓ_b/exp(u) + u.
The ops come from `fasttrain.kernels` (noise.py, diffusion_loss.py); every backend draws the same
noise stream.
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.kernels import philox
from fasttrain.kernels.backend import BACKENDS, resolve_backend
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise

from . import prediction as P
from .samplers import TimestepSampler, timestep_sampler
from .schedule import NoiseSchedule
from .stats import TimestepStats
from .weighting import effective_x0_weight, loss_weight, uncertainty_loss



class DiffusionObjective(nn.Module):
    def __init__(self, schedule: NoiseSchedule, prediction: str = "eps", weighting="simple",
                 sampler="uniform", *, weighting_args: dict | None = None, sampler_args: dict | None = None,
                 stats: TimestepStats | bool = True, learned_weighting: bool = False,
                 backend: str = "auto", seed: int = 0):
        super().__init__()
        self.schedule = schedule
        self.prediction = P.check(prediction)
        self.pred = P.get(prediction)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.backend = backend  # resolved per call against the data's device
        if isinstance(weighting, str):
            weighting = loss_weight(weighting, schedule, prediction, **(weighting_args or {}))
        # fp32 copies of the tables: what the kernels gather by t
        self.register_buffer("weight", weighting.to(torch.float32), persistent=False)
        self.register_buffer("weight64", weighting.to(torch.float64), persistent=False)  # for plots
        self.register_buffer("alpha", schedule.alpha.float(), persistent=False)
        self.register_buffer("sigma", schedule.sigma.float(), persistent=False)
        self.register_buffer("coef", self.pred.table(schedule.alpha, schedule.sigma), persistent=False)
        self.register_buffer("offset", torch.zeros((), dtype=torch.int64), persistent=False)
        self.sampler: TimestepSampler = (timestep_sampler(sampler, schedule, **(sampler_args or {}))
                                         if isinstance(sampler, str) else sampler)
        if stats is True:
            stats = TimestepStats(schedule.T, schedule.device, history=getattr(self.sampler, "history", 0))
        self.stats: TimestepStats | None = stats or None
        self.learned_weighting = bool(learned_weighting)
        self.seed = philox.check_seed(seed)
        self.input_dtype: torch.dtype | None = None  # x_t's dtype (the model's compute dtype); None: x0's

    def _apply(self, fn, recurse=True):
        # Keep the non-module pieces (sampler, stats, schedule) on the same device as the buffers.
        out = super()._apply(fn, recurse)
        dev = self.alpha.device
        self.schedule = self.schedule.to(dev)
        self.sampler.to(dev)
        if self.stats is not None:
            self.stats.to(dev)
        return out

    @property
    def T(self) -> int:
        return self.schedule.T

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """The eps of the next (seed, offset) (what the kernels would draw); advances the offset."""
        eps = philox.randn(like.shape, self.seed, self.offset.to(like.device), like.device)
        self.offset += like.numel()
        return eps

    def draw(self, x0: torch.Tensor, generator: torch.Generator | None = None, t: torch.Tensor | None = None):
        """The step's (t, iw, backend, noise offset, x_t): timesteps from the sampler (or given, iw = 1),
        the noise op at this step's counter; the device counter moves on in place."""
        B = x0.shape[0]
        if t is None:
            t, iw = self.sampler.sample(B, generator, x0)
        else:
            iw = torch.ones(B, device=x0.device)
        backend = resolve_backend(self.backend, x0.device)
        offset = self.offset.clone()
        self.offset += x0.numel()
        x_t = noise(x0, t, self.alpha, self.sigma, seed=self.seed, offset=offset, out_dtype=self.input_dtype,
                    backend=backend)
        return t, iw, backend, offset, x_t

    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None):
        t, iw, backend, offset, x_t = self.draw(x0, generator, t)
        kw = {} if cond is None else {"y": cond}
        if self.learned_weighting:
            pred, logvar = model(x_t, t, return_logvar=True, **kw)
        else:
            pred, logvar = model(x_t, t, **kw), None
        st = self.stats
        loss, per_sample, raw, weighted = diffusion_loss(pred, x0, t, self.weight, iw, self.coef, uses=self.pred.uses,
                                                         seed=self.seed, offset=offset, backend=backend,
                                                         bins=st.window if st is not None else None)
        if st is not None:
            st.record(t, weighted)
        if logvar is not None:
            per_sample = uncertainty_loss(per_sample, logvar)
            loss = per_sample.mean()
        info = {"t": t, "iw": iw, "raw": raw.detach(), "weighted": weighted.detach(),
                "loss_per_sample": per_sample.detach()}
        return loss, info

    def probe_loss(self, model, x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, cond=None) -> torch.Tensor:
        """Per-sample loss ℓ_b (iw = 1) at the given t and eps, with no statistics and no noise-counter
        move: for probes (diagnostics, look-aheads). Differentiable in the model's parameters."""
        backend = resolve_backend(self.backend, x0.device)
        x_t = noise(x0, t, self.alpha, self.sigma, eps=eps, backend=backend)
        kw = {} if cond is None else {"y": cond}
        pred, logvar = model(x_t, t, return_logvar=True, **kw) if self.learned_weighting else (model(x_t, t, **kw), None)
        iw = torch.ones(x0.shape[0], device=x0.device)
        per = diffusion_loss(pred, x0, t, self.weight, iw, self.coef, uses=self.pred.uses, eps=eps,
                             backend=backend).per_sample
        return per if logvar is None else uncertainty_loss(per, logvar)

    def x0_hat(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The network's estimate of x0 from its raw output at (x_t, t): the one conversion that
        look-aheads, diagnostics and generation use (prediction.py; a mixed prediction overrides it)."""
        shape = (-1,) + (1,) * (x_t.ndim - 1)
        a, s = self.alpha[t].view(shape).to(x_t.dtype), self.sigma[t].view(shape).to(x_t.dtype)
        return self.pred.to_x0_eps(output.to(x_t.dtype), x_t, a, s)[0]

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

    # -- persistence: shared (identical on every rank) and per-rank parts --------------------------
    def extra_state(self) -> dict:
        return {"offset": int(self.offset), "sampler": self.sampler.state_dict(),
                "stats": self.stats.state_dict() if self.stats is not None else None}

    def load_extra_state(self, state: dict) -> None:
        """The seed is not restored: it is derived per rank from the config (seeds.py)."""
        self.offset.fill_(int(state["offset"]))
        self.sampler.load_state_dict(state["sampler"])
        if self.stats is not None and state["stats"] is not None:
            self.stats.load_state_dict(state["stats"])

    def rank_state(self) -> dict:
        return {"window": self.stats.window_state() if self.stats is not None else None}

    def load_rank_state(self, state: dict | None) -> None:
        if self.stats is not None:
            self.stats.load_window_state(None if state is None else state["window"])
