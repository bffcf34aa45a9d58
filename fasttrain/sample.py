"""Samplers for trained models, on respaced steps, for any prediction type (through x̂0 and ε̂), with
classifier-free guidance:

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
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .diffusion import prediction as P
from .diffusion.schedule import NoiseSchedule

METHODS = ("ddim", "ddpm", "heun", "flow_euler", "flow_heun")


def respaced(T: int, steps: int) -> list[int]:
    """`steps` timesteps from T-1 down to 0, evenly spaced (iDDPM respacing), strictly decreasing."""
    if not 1 <= steps <= T:
        raise ValueError(f"steps must lie in [1, T={T}], got {steps!r}")
    ts = torch.linspace(T - 1, 0, steps).round().long().tolist()
    return sorted(set(ts), reverse=True)


def edm_timesteps(schedule: NoiseSchedule, steps: int, rho: float = 7.0, sigma_max: float = 80.0) -> list[int]:
    """Karras et al. 2022, Eq. 5: sigma_i = (smax^(1/ρ) + i/(N-1)·(smin^(1/ρ) - smax^(1/ρ)))^ρ, each
    mapped to the timestep with the nearest log sigma_e; strictly decreasing."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    log_se = torch.log(schedule.edm_sigma().cpu())  # increasing in t, +inf at a zero-SNR step
    smin = float(log_se[0].exp())
    smax = min(sigma_max, float(log_se[torch.isfinite(log_se)].max().exp()))
    i = torch.arange(steps, dtype=torch.float64) / max(steps - 1, 1)
    sig = (smax ** (1 / rho) + i * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    t = torch.searchsorted(log_se.contiguous(), torch.log(sig)).clamp(max=schedule.T - 1)
    # pick the nearer of the two neighbours in log sigma
    prev = (t - 1).clamp(min=0)
    t = torch.where((torch.log(sig) - log_se[prev]).abs() < (log_se[t] - torch.log(sig)).abs(), prev, t)
    return sorted(set(t.tolist()), reverse=True)


@torch.no_grad()
def sample(model, schedule: NoiseSchedule, prediction: str, shape, *, steps: int = 50, method: str = "ddim",
           eta: float | None = None, labels: torch.Tensor | None = None, guidance: float = 1.0,
           null_label: int | None = None, clip_x0: float | None = 1.0, generator: torch.Generator | None = None,
           device="cpu", progress: bool = False) -> torch.Tensor:
    if method not in METHODS:
        raise ValueError(f"unknown sampling method {method!r}; choose from {', '.join(METHODS)}")
    eta = (1.0 if method == "ddpm" else 0.0) if eta is None else float(eta)
    device = torch.device(device)
    alpha, sigma = schedule.alpha.to(device), schedule.sigma.to(device)
    x = torch.randn(shape, generator=generator, device=device)
    B = shape[0]

    def model_fn(x_t, t):
        tt = torch.full((B,), t, device=device, dtype=torch.long)
        if labels is None:
            return model(x_t, tt)
        if guidance == 1.0:
            return model(x_t, tt, labels)
        null = torch.full_like(labels, null_label)
        out = model(torch.cat([x_t, x_t]), torch.cat([tt, tt]), torch.cat([labels, null]))
        cond, uncond = out.chunk(2)
        return uncond + guidance * (cond - uncond)  # Ho & Salimans 2022, Eq. 6

    ts = edm_timesteps(schedule, steps) if method == "heun" else respaced(schedule.T, steps)

    def denoise(x_t, t):
        a_t, s_t = alpha[t].float(), sigma[t].float()
        x0, eps = P.to_x0_eps(prediction, model_fn(x_t, t).float(), x_t, a_t, s_t)
        if clip_x0 is not None:
            x0 = x0.clamp(-clip_x0, clip_x0)
            eps = (x_t - a_t * x0) / s_t  # keep ε̂ consistent with the clipped x̂0
        return x0, eps

    if method in ("flow_euler", "flow_heun") and schedule.is_vp:
        raise ValueError(f"sampling method {method!r} needs the flow schedule, not {schedule.name!r}")
    bar = tqdm(total=len(ts), desc="sampling", disable=not progress, leave=False)
    i = 0
    while i < len(ts):
        t = ts[i]
        a_t, s_t = alpha[t].float(), sigma[t].float()
        nxt = ts[i + 1] if i + 1 < len(ts) else None
        a_s, s_s = (alpha[nxt].float(), sigma[nxt].float()) if nxt is not None else (torch.ones(()), torch.zeros(()))
        x0, eps = denoise(x, t)
        if nxt is None:
            x = x0  # the last step lands on clean data (a = 1, s = 0)
        elif method in ("ddim", "ddpm"):
            var_ts = (s_t**2 - (a_t / a_s) ** 2 * s_s**2).clamp_min(0)
            c = eta * torch.sqrt(var_ts * s_s**2 / s_t**2)
            x = a_s * x0 + torch.sqrt((s_s**2 - c**2).clamp_min(0)) * eps
            if eta > 0:
                x = x + c * torch.randn(x.shape, generator=generator, device=device)
        elif method == "heun":
            se_t, se_s = s_t / a_t, s_s / a_s
            y = x / a_t
            y_next = y + (se_s - se_t) * eps  # Euler step of dy/dsigma_e = ε̂
            _, eps2 = denoise(a_s * y_next, nxt)
            x = a_s * (y + (se_s - se_t) * (eps + eps2) / 2)  # Heun correction
        else:
            u = eps - x0  # rectified-flow velocity
            x_next = x + (s_s - s_t) * u
            if method == "flow_heun":
                x0b, epsb = denoise(x_next, nxt)
                x_next = x + (s_s - s_t) * (u + (epsb - x0b)) / 2
            x = x_next
        i += 1
        bar.update(1)
    bar.close()
    return x
