"""Timestep samplers: `sample(n, generator, x0=None) -> (t: Long[n], iw: Float[n])`.

All sampling happens on the device of the sampler's tables with no host sync (no `.item()`, no
`multinomial` validity checks): discrete tables are drawn by inverse CDF (`searchsorted`), continuous
densities by their closed-form or tabulated inverse. `probs()` is the exact marginal over t.
Biased samplers (they change the objective on purpose) return iw = 1; the unbiased importance sampler
returns iw = 1/(T·p_t) so that E[iw·loss] equals the uniform-t objective (Nichol & Dhariwal 2021, §3.3).

A sampler is a class registered by name (`@register("name")`); its constructor's keyword arguments
are its config arguments (`diffusion.sampler_args.*`). What a sampler needs from the rest of the
trainer is declared on `TimestepSampler`, with defaults, never discovered by attribute:

  history        losses per timestep it reads from the statistics' ring (0: none); sizes the ring
  seeded         its constructor takes `seed` (its own weights or noise); the objective derives one
  lookahead()    the `LookAhead` it learns from around the optimizer step (adaptive.py), or None
  observe(stats) called with the all-reduced statistics every K steps (samplers that learn from them)
  set_partition  where this process's micro-batches sit in the global batch (stratified sampling)
  metrics()      values for the trainer's log lines;  p_history(bins): its learned p(t) over training
  capture_problem()  why a CUDA graph cannot capture a step that draws from it (None: it can)
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import InvalidInput
from ..registry import Registry
from .schedule import NoiseSchedule

SAMPLERS = Registry("timestep sampler", positional=1)  # cls(schedule, **args)
register = SAMPLERS.register


class TimestepSampler:
    name = "base"
    biased = True      # False: returns importance weights that keep the uniform-t objective
    history = 0        # losses per timestep read from TimestepStats' ring in observe() (0: none)
    seeded = False     # the constructor takes `seed` (the objective passes one derived from train.seed)

    def __init__(self, schedule: NoiseSchedule):
        self.T = schedule.T
        self.device = schedule.device

    # -- interface -------------------------------------------------------------------------------
    def sample(self, n: int, generator: torch.Generator | None = None, x0: torch.Tensor | None = None):
        """n timesteps and their importance weights; `x0` is the batch, for samplers conditioned on it."""
        t = self._draw(n, generator)
        return t, torch.ones(n, dtype=torch.float32, device=self.device)

    def probs(self, n: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, stats) -> None:
        """Called every K steps with the (all-reduced) TimestepStats; samplers that learn from them do here."""

    def set_partition(self, rank: int = 0, world_size: int = 1, accum_steps: int = 1) -> None:
        """Where this process's micro-batches sit in the global batch (stratified sampling)."""

    def lookahead(self):
        """The `lookahead.LookAhead` this sampler learns from around the optimizer step, or None."""
        return None

    def metrics(self) -> dict:
        """Values for the trainer's log lines (0-d tensors or floats); read at log steps only."""
        return {}

    def p_history(self, bins: int = 100) -> dict | None:
        """The learned p(t) over training for plots ({"steps", "p", "S", "T"} host arrays), or None
        for a sampler whose p(t) does not change."""
        return None

    def capture_problem(self) -> str | None:
        """Why a step that draws from this sampler cannot be captured in a CUDA graph, or None."""
        if self.lookahead() is not None:
            return f"the {self.name} sampler's look-ahead runs host logic around the optimizer step"
        if self.history > 0:
            return f"the {self.name} sampler keeps a host-side queue of recent losses"
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def to(self, device) -> TimestepSampler:
        self.device = torch.device(device)
        for k, v in list(vars(self).items()):
            if isinstance(v, torch.Tensor):
                setattr(self, k, v.to(device))
        return self

    # -- helpers ---------------------------------------------------------------------------------
    def _rand(self, n, generator, dtype=torch.float64):
        return torch.rand(n, generator=generator, device=self.device, dtype=dtype)

    def _randn(self, n, generator):
        return torch.randn(n, generator=generator, device=self.device, dtype=torch.float64)

    def _from_unit(self, u: torch.Tensor) -> torch.Tensor:
        """Map u in [0, 1] (1 = most noise) to t = floor(u·T) in [0, T-1]."""
        return torch.clamp((u * self.T).long(), 0, self.T - 1)


def _draw_table(cdf: torch.Tensor, n: int, generator, device) -> torch.Tensor:
    """Inverse-CDF draw from an (unnormalised) cumulative table: P(t = i) = p_i / Σp."""
    u = torch.rand(n, generator=generator, device=device, dtype=cdf.dtype) * cdf[-1]
    return torch.clamp(torch.searchsorted(cdf, u, right=True), max=cdf.numel() - 1)


@register("uniform")
class Uniform(TimestepSampler):
    biased = False

    def _draw(self, n, generator):
        return torch.randint(0, self.T, (n,), generator=generator, device=self.device)

    def probs(self, n=None):
        return torch.full((self.T,), 1.0 / self.T, dtype=torch.float64, device=self.device)


@register("stratified")
class Stratified(Uniform):
    """One stratum of [0, 1) per sample of the *global* batch (k-diffusion `stratified_uniform`):
    the batch of micro-step m on rank r is group g = r·accum + m of G = world·accum groups, and its
    j-th sample draws u ~ U[(j·G + g)/N, (j·G + g + 1)/N) with N = n·G. The marginal stays uniform."""

    def __init__(self, schedule):
        super().__init__(schedule)
        self.rank, self.world_size, self.accum_steps, self.micro_step = 0, 1, 1, 0

    def set_partition(self, rank=0, world_size=1, accum_steps=1):
        self.rank, self.world_size, self.accum_steps = rank, world_size, accum_steps

    def _draw(self, n, generator):
        groups = self.world_size * self.accum_steps
        group = self.rank * self.accum_steps + self.micro_step
        self.micro_step = (self.micro_step + 1) % self.accum_steps
        offsets = torch.arange(n, device=self.device, dtype=torch.float64) * groups + group
        return self._from_unit((offsets + self._rand(n, generator)) / (n * groups))

    def state_dict(self):
        return {"micro_step": self.micro_step}

    def load_state_dict(self, state):
        self.micro_step = int(state["micro_step"])


@register("logit_normal")
class LogitNormal(TimestepSampler):
    """SD3 (Esser et al. 2024, Eq. 19): u = sigmoid(m + s·n), n ~ N(0, 1); t = floor(u·T)."""

    def __init__(self, schedule, mean: float = 0.0, std: float = 1.0):
        super().__init__(schedule)
        if not std > 0:
            raise InvalidInput(f"std must be > 0, got {std!r}")
        self.mean, self.std = float(mean), float(std)

    def _draw(self, n, generator):
        return self._from_unit(torch.sigmoid(self.mean + self.std * self._randn(n, generator)))

    def probs(self, n=None):
        edges = torch.arange(self.T + 1, dtype=torch.float64, device=self.device) / self.T
        cdf = torch.special.ndtr((torch.logit(edges) - self.mean) / self.std)  # logit(0) = -inf
        return cdf[1:] - cdf[:-1]


@register("mode")
class Mode(TimestepSampler):
    """SD3 mode sampling (Esser et al. 2024, Eq. 20): f(u) = 1 - u - s·(cos²(πu/2) - 1 + u),
    monotone for s in [-1, 2/(π-2)]; t = floor(f(u)·T). probs() inverts f by bisection."""

    def __init__(self, schedule, scale: float = 1.29):
        super().__init__(schedule)
        if not -1.0 <= scale <= 2 / (math.pi - 2):
            raise InvalidInput(f"scale must lie in [-1, {2 / (math.pi - 2):.4f}] for a monotone map, got {scale!r}")
        self.scale = float(scale)

    def _f(self, u):
        return 1 - u - self.scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)

    def _draw(self, n, generator):
        return self._from_unit(self._f(self._rand(n, generator)))

    def probs(self, n=None):
        y = torch.arange(self.T + 1, dtype=torch.float64, device=self.device) / self.T
        lo, hi = torch.zeros_like(y), torch.ones_like(y)
        for _ in range(64):  # f is decreasing: find u with f(u) = y
            mid = (lo + hi) / 2
            above = self._f(mid) > y
            lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
        u = (lo + hi) / 2
        return (u[:-1] - u[1:]).clamp_min(0)


@register("lognormal")
class LogNormal(TimestepSampler):
    """EDM (Karras et al. 2022, Table 1): ln sigma_e ~ N(P_mean, P_std²) in VE units sigma_e = s/a,
    mapped to the timestep whose ln sigma_e is nearest (edges at midpoints in log space)."""

    def __init__(self, schedule, p_mean: float = -1.2, p_std: float = 1.2):
        super().__init__(schedule)
        if not p_std > 0:
            raise InvalidInput(f"p_std must be > 0, got {p_std!r}")
        self.p_mean, self.p_std = float(p_mean), float(p_std)
        self.schedule = schedule
        self.edges = schedule.log_sigma_edges().to(self.device)

    def _draw(self, n, generator):
        z = self.p_mean + self.p_std * self._randn(n, generator)
        return self.schedule.nearest_timestep(z, self.edges)

    def probs(self, n=None):
        inf = torch.tensor([math.inf], dtype=torch.float64, device=self.device)
        cdf = torch.special.ndtr((torch.cat([-inf, self.edges, inf]) - self.p_mean) / self.p_std)
        return cdf[1:] - cdf[:-1]


@register("speed")
class Speed(TimestepSampler):
    """SpeeD asymmetric sampling, exactly as the official `sampling="ours"`
    (`speed/diffusion/speed/__init__.py`): p ∝ [k]*τ + [1]*(T-τ); draw n//2+1 timesteps, mirror
    each around m = argmax(gradient(sqrt(1-ᾱ)) < 1e-4) + 1 (t < m → m-t, else t-m), keep the first n
    of [t, dual_t]. Without `dual` all n are drawn from p (the official `no_dual`)."""

    def __init__(self, schedule, k: float = 5.0, tau: int = 700, dual: bool = True):
        super().__init__(schedule)
        if not k > 0:
            raise InvalidInput(f"k must be > 0, got {k!r}")
        if not 0 <= tau <= self.T:
            raise InvalidInput(f"tau must lie in [0, T={self.T}], got {tau!r}")
        self.k, self.tau, self.dual = float(k), int(tau), bool(dual)
        p = torch.ones(self.T, dtype=torch.float64)
        p[: self.tau] = self.k
        self.p = (p / p.sum()).to(self.device)
        self.cdf = torch.cumsum(self.p, 0)
        grad = np.gradient(schedule.sigma.cpu().numpy())  # sigma = sqrt(1 - ᾱ)
        flat = grad < 1e-4
        self.m = int(np.argmax(flat)) + 1
        if self.dual and (not flat.any() or self.m >= self.T):
            # e.g. the flow schedule: sigma grows linearly, so there is no convergence area to mirror
            raise InvalidInput(f"sampler 'speed' with dual=true needs a schedule whose sigma saturates "
                             f"(d sigma/dt < 1e-4 somewhere), which {schedule.name!r} does not; use "
                             f"diffusion.sampler_args.dual=false")

    def _mirror(self, t):
        return torch.where(t < self.m, self.m - t, t - self.m)

    def _draw(self, n, generator):
        if not self.dual:
            return _draw_table(self.cdf, n, generator, self.device)
        t = _draw_table(self.cdf, n // 2 + 1, generator, self.device)
        return torch.cat([t, self._mirror(t)])[:n]

    def probs(self, n: int | None = None):
        """Marginal over the batch; with the mirror it depends on n (n//2+1 primaries, the rest
        mirrored). n = None gives the large-batch limit, half primaries and half mirrored."""
        if not self.dual:
            return self.p.clone()
        dual = torch.zeros_like(self.p).index_add_(0, self._mirror(torch.arange(self.T, device=self.device)), self.p)
        frac = 0.5 if n is None else min(n, n // 2 + 1) / n
        return frac * self.p + (1 - frac) * dual


@register("loss_second_moment")
class LossSecondMoment(TimestepSampler):
    """iDDPM `LossSecondMomentResampler` (improved_diffusion/resample.py): p_t ∝ sqrt(E[L_t²]) over the
    last `history` losses of each t, mixed with `uniform_prob` of uniform; uniform until every t has
    `history` losses. Unbiased: iw = 1/(T·p_t). Reads the loss ring of TimestepStats in `observe`."""
    biased = False

    def __init__(self, schedule, history: int = 10, uniform_prob: float = 0.001):
        super().__init__(schedule)
        if not (isinstance(history, int) and history >= 1):
            raise InvalidInput(f"history must be an integer >= 1, got {history!r}")
        if not 0 < uniform_prob <= 1:
            raise InvalidInput(f"uniform_prob must lie in (0, 1], got {uniform_prob!r}")
        self.history, self.uniform_prob = history, float(uniform_prob)
        self.p = torch.full((self.T,), 1.0 / self.T, dtype=torch.float64, device=self.device)

    def observe(self, stats):
        ring, count = stats.history_ring(self.history)
        w = torch.sqrt(torch.mean(ring.double() ** 2, dim=1))
        p = w / w.sum() * (1 - self.uniform_prob) + self.uniform_prob / self.T
        warm = (count >= self.history).all() & (w.sum() > 0)
        self.p = torch.where(warm, p, torch.full_like(p, 1.0 / self.T)).to(self.device)

    def sample(self, n, generator=None, x0=None):
        t = _draw_table(torch.cumsum(self.p, 0), n, generator, self.device)
        return t, (1.0 / (self.T * self.p[t])).float()

    def probs(self, n=None):
        return self.p.clone()

    def state_dict(self):
        return {"p": self.p.cpu()}

    def load_state_dict(self, state):
        self.p = state["p"].to(self.device, torch.float64)


def timestep_sampler(name: str, schedule: NoiseSchedule, **args) -> TimestepSampler:
    """Build a sampler by name; its tables live on `schedule.device`."""
    return SAMPLERS.build(name, schedule, **args)
