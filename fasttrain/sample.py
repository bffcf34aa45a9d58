"""Samplers for trained models: DDIM with η (η = 1 is ancestral DDPM) on respaced steps, any
prediction type (through x̂0 and ε̂), classifier-free guidance.

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

METHODS = ("ddim", "ddpm")


def respaced(T: int, steps: int) -> list[int]:
    """`steps` timesteps from T-1 down to 0, evenly spaced (iDDPM respacing), strictly decreasing."""
    if not 1 <= steps <= T:
        raise ValueError(f"steps must lie in [1, T={T}], got {steps!r}")
    ts = torch.linspace(T - 1, 0, steps).round().long().tolist()
    return sorted(set(ts), reverse=True)


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

    ts = respaced(schedule.T, steps)
    for i, t in enumerate(tqdm(ts, desc="sampling", disable=not progress, leave=False)):
        a_t, s_t = alpha[t].float(), sigma[t].float()
        pred = model_fn(x, t).float()
        x0, eps = P.to_x0_eps(prediction, pred, x, a_t, s_t)
        if clip_x0 is not None:
            x0 = x0.clamp(-clip_x0, clip_x0)
            eps = (x - a_t * x0) / s_t  # keep ε̂ consistent with the clipped x̂0
        if i + 1 == len(ts):
            x = x0  # s = -1: clean data, a_s = 1, s_s = 0
            break
        s = ts[i + 1]
        a_s, s_s = alpha[s].float(), sigma[s].float()
        var_ts = (s_t**2 - (a_t / a_s) ** 2 * s_s**2).clamp_min(0)
        c = eta * torch.sqrt(var_ts * s_s**2 / s_t**2)
        x = a_s * x0 + torch.sqrt((s_s**2 - c**2).clamp_min(0)) * eps
        if eta > 0:
            x = x + c * torch.randn(x.shape, generator=generator, device=device)
    return x
