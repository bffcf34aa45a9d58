"""Generation solvers: functions sharing one signature (k-diffusion's style), registered by name.

    x = solver(denoise, x, ts, schedule, generator=g, **options)

`denoise(x_t, t) -> (x̂0, ε̂)` is the trained network turned into estimates (guidance, clipping and
the prediction type's conversion live there, see bundle.py); `ts` is the strictly decreasing list of
timesteps the solver visits, from `spacing(...)`. ("Solvers" generate; "timestep samplers" in
samplers.py choose training timesteps.)

Step spacings (`sample.spacing`), named and computed as diffusers' schedulers compute them
(`timestep_spacing`; Lin et al. 2024, Table 2), so that a stock scheduler visits the same timesteps:
  trailing   T−1, T−1−T/n, … (rounded): the last step lands on x̂0 from t ≈ T/n − 1 (new runs)
  linspace   T−1 … 0, evenly spaced and rounded (iDDPM respacing; runs before checkpoint format 4)
  leading    0, T//n, 2·T//n, … reversed (DDIMScheduler's default; starts below T−1)
The solvers always step to the next listed timestep; diffusers' DDIMScheduler steps to t − T//n
whatever the list, which is the same list for trailing and leading when n divides T.

Noise is drawn as diffusers' `randn_tensor` draws it: from the generator's own device, then moved, so
one CPU generator gives the same samples on any device (and as a diffusers pipeline given it).

  ddim, ddpm   DDIM with η (η = 1 is ancestral DDPM), any schedule
  heun         EDM's 2nd-order Heun on the probability-flow ODE (Karras et al. 2022, Alg. 1 without
               churn) in VE coordinates y = x/a, sigma_e = s/a: dy/dsigma_e = ε̂, on EDM's step
               spacing (Eq. 5, ρ = 7, sigma_e ≤ 80) snapped to the model's discrete timesteps
  flow_euler,  Euler / Heun on the rectified-flow ODE dx/ds = ε̂ - x̂0 (flow schedule only)
  flow_heun

Written for a general schedule x_t = a_t·x0 + s_t·eps (VP or rectified flow). Between steps t > s
(Kingma et al. 2021, VDM, Eq. 33): a_{t|s} = a_t/a_s, s²_{t|s} = s_t² − a_{t|s}²·s_s², and the DDPM
posterior variance is s²_{t|s}·s_s²/s_t². DDIM (Song et al. 2021, Eq. 12) takes
x_s = a_s·x̂0 + sqrt(s_s² − c²)·ε̂ + c·z with c² = η²·s²_{t|s}·s_s²/s_t²; η = 1 reproduces the
ancestral DDPM step, η = 0 is deterministic (and equals the flow Euler step on a flow schedule).
Every solver's last step lands on x̂0.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import InvalidInput
from ..registry import Registry
from .schedule import NoiseSchedule

# fn(denoise, x, ts, schedule, *, generator, **options); declared per solver: its step spacing and
# whether it needs the flow schedule
SOLVERS = Registry("solver", positional=4, defaults={"spacing": "uniform", "requires_flow": False})
register = SOLVERS.register


SPACINGS = ("trailing", "linspace", "leading")


def respaced(T: int, steps: int, kind: str = "linspace") -> list[int]:
    """`steps` timesteps of [0, T−1] in the spacing `kind` (module docstring), strictly decreasing."""
    if not 1 <= steps <= T:
        raise InvalidInput(f"steps must lie in [1, T={T}], got {steps!r}")
    if kind == "linspace":
        ts = torch.linspace(T - 1, 0, steps).round().long().tolist()
    elif kind == "trailing":  # diffusers: np.round(np.arange(T, 0, -T/n)) − 1, in float64 as there
        ts = (np.round(np.arange(T, 0, -T / steps)).astype(np.int64) - 1).tolist()
    elif kind == "leading":  # diffusers: (np.arange(n) · (T // n)).round()[::-1] (steps_offset 0)
        ts = (np.arange(0, steps) * (T // steps)).tolist()
    else:
        raise InvalidInput(f"unknown step spacing {kind!r}; choose from {', '.join(SPACINGS)}")
    return sorted({t for t in ts if 0 <= t < T}, reverse=True)


def edm_timesteps(schedule: NoiseSchedule, steps: int, rho: float = 7.0, sigma_max: float = 80.0) -> list[int]:
    """Karras et al. 2022, Eq. 5: sigma_i = (smax^(1/ρ) + i/(N-1)·(smin^(1/ρ) - smax^(1/ρ)))^ρ, each
    mapped to the nearest timestep in ln sigma_e; strictly decreasing."""
    if steps < 1:
        raise InvalidInput(f"steps must be >= 1, got {steps!r}")
    log_se = torch.log(schedule.edm_sigma().cpu())  # increasing in t, +inf at a zero-SNR step
    smin = float(log_se[0].exp())
    smax = min(sigma_max, float(log_se[torch.isfinite(log_se)].max().exp()))
    i = torch.arange(steps, dtype=torch.float64) / max(steps - 1, 1)
    sig = (smax ** (1 / rho) + i * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    t = schedule.to("cpu").nearest_timestep(torch.log(sig))
    return sorted(set(t.clamp(max=schedule.T - 1).tolist()), reverse=True)


def spacing(solver: str, schedule: NoiseSchedule, steps: int, kind: str = "trailing") -> list[int]:
    """The timesteps `solver` visits: its own spacing (heun: EDM's), else the spacing `kind`."""
    fn = SOLVERS.get(solver)
    return edm_timesteps(schedule, steps) if fn.spacing == "edm" else respaced(schedule.T, steps, kind)


def randn(shape, generator, device, dtype=torch.float32) -> torch.Tensor:
    """N(0, I) drawn on the generator's device and moved to `device` (diffusers' `randn_tensor`). A list
    of generators draws row i from generator i (as `randn_tensor` does): each image its own noise stream,
    whatever batch it is generated in (generation/ranks.py: the same images on any number of ranks)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g, device=g.device, dtype=dtype)
                            for g in generator]).to(device)
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where, dtype=dtype).to(device)


def _tables(schedule, t, device):
    if t is None:  # past the last step: clean data
        return torch.ones((), device=device), torch.zeros((), device=device)
    return schedule.alpha[t].float().to(device), schedule.sigma[t].float().to(device)


def _steps(ts, schedule, device, progress: bool):
    """(t, next t, (α_t, σ_t), (α_next, σ_next)) along the spacing, with the progress bar; next is None
    at the last step, where a solver returns its x̂0."""
    for i, t in enumerate(tqdm(ts, desc="sampling", disable=not progress, leave=False)):
        nxt = ts[i + 1] if i + 1 < len(ts) else None
        yield t, nxt, _tables(schedule, t, device), _tables(schedule, nxt, device)


@register("ddim")
def ddim(denoise, x, ts, schedule, *, generator=None, eta: float = 0.0, progress: bool = False):
    for t, nxt, (a_t, s_t), (a_s, s_s) in _steps(ts, schedule, x.device, progress):
        x0, eps = denoise(x, t)
        if nxt is None:
            return x0
        var_ts = (s_t**2 - (a_t / a_s) ** 2 * s_s**2).clamp_min(0)
        c = eta * torch.sqrt(var_ts * s_s**2 / s_t**2)
        x = a_s * x0 + torch.sqrt((s_s**2 - c**2).clamp_min(0)) * eps
        if eta > 0:
            x = x + c * randn(x.shape, generator, x.device)
    return x


@register("ddpm")
def ddpm(denoise, x, ts, schedule, *, generator=None, eta: float = 1.0, progress: bool = False):
    return ddim(denoise, x, ts, schedule, generator=generator, eta=eta, progress=progress)


@register("heun", spacing="edm")
def heun(denoise, x, ts, schedule, *, generator=None, progress: bool = False):
    for t, nxt, (a_t, s_t), (a_s, s_s) in _steps(ts, schedule, x.device, progress):
        x0, eps = denoise(x, t)
        if nxt is None:
            return x0
        se_t, se_s = s_t / a_t, s_s / a_s
        y = x / a_t
        _, eps2 = denoise(a_s * (y + (se_s - se_t) * eps), nxt)  # Euler step of dy/dsigma_e = ε̂
        x = a_s * (y + (se_s - se_t) * (eps + eps2) / 2)  # Heun correction
    return x


def _flow(denoise, x, ts, schedule, second_order: bool, progress: bool):
    if schedule.is_vp:
        raise InvalidInput(f"the flow solvers need the flow schedule, not {schedule.name!r}")
    for t, nxt, (_, s_t), (_, s_s) in _steps(ts, schedule, x.device, progress):
        x0, eps = denoise(x, t)
        if nxt is None:
            return x0
        u = eps - x0  # rectified-flow velocity
        x_next = x + (s_s - s_t) * u
        if second_order:
            x0b, epsb = denoise(x_next, nxt)
            x_next = x + (s_s - s_t) * (u + (epsb - x0b)) / 2
        x = x_next
    return x


@register("flow_euler", requires_flow=True)
def flow_euler(denoise, x, ts, schedule, *, generator=None, progress: bool = False):
    return _flow(denoise, x, ts, schedule, False, progress)


@register("flow_heun", requires_flow=True)
def flow_heun(denoise, x, ts, schedule, *, generator=None, progress: bool = False):
    return _flow(denoise, x, ts, schedule, True, progress)


@torch.no_grad()
def generate(denoise, schedule: NoiseSchedule, shape, *, solver: str = "ddim", steps: int = 50,
             generator: torch.Generator | None = None, device="cpu", progress: bool = False,
             spacing_kind: str = "trailing", **options) -> torch.Tensor:
    """Start from N(0, I) (the prior at t = T-1; with a nonzero a_{T-1} the remaining signal is
    negligible for the supported schedules) and run a solver over its step spacing."""
    fn = SOLVERS.get(solver)
    check_options(solver, schedule, **options)
    x = randn(shape, generator, device)
    ts = spacing(solver, schedule, steps, spacing_kind)
    return fn(denoise, x, ts, schedule, generator=generator, progress=progress, **options)


def check_options(solver: str, schedule: NoiseSchedule, **options) -> None:
    """One check of a solver's options for the config (`sample.*`) and the command line (`--eta`):
    the solver takes them, their values are in range, and it fits the schedule. None means "unset"."""
    fn = SOLVERS.get(solver)
    given = {k: v for k, v in options.items() if v is not None}
    takes = SOLVERS.args(solver)
    for k in given:
        if k not in takes:
            raise InvalidInput(f"unknown argument {k!r} (solver {solver!r} takes no {k})")
    SOLVERS.check_args(solver, given)
    eta = given.get("eta")
    if eta is not None and not (eta == eta and 0 <= eta < float("inf")):
        raise InvalidInput(f"eta must be a finite number >= 0, got {eta!r}")
    if fn.requires_flow and schedule.is_vp:
        raise InvalidInput(f"solver {solver!r} needs the flow schedule, not {schedule.name!r}")
