"""Loss weightings, each defined on the x0-space MSE and converted to the prediction's space.

`loss_weight(name, schedule, prediction, **args)` returns a float64 [T] table w such that the
training loss is w[t]·mean((pred - target)²). Internally every weighting is an x0-space weight
w_x0(t) and w = w_x0 / c(t) (prediction.c_factor), so the *effective* x0-space weight
p(t)·iw(t)·w(t)·c(t) of a strategy does not depend on the prediction type (research notes §0).

Where SNR = 0 (zero-terminal schedules, the last flow step) the weight is 1: the official Min-SNR
code sets `mse_loss_weight[snr == 0] = 1.0` (Min-SNR PR #4), which also avoids 0/0 and inf.

Names and x0-space definitions (SNR = a²/s², sigma_e = s/a the EDM noise level):
  simple         c(t)                 plain MSE of the prediction (the one weight set in its own space)
  constant       1                    the x0-MSE
  snr            SNR                  the eps-MSE (DDPM L_simple)
  min_snr(γ)     min(SNR, γ)          Hang et al. 2023: eps min(SNR,γ)/SNR, v min(SNR,γ)/(SNR+1)
  max_snr(γ)     max(SNR, γ)          the official code's `max_snr_k`
  soft_min_snr(σd) 1/(sigma_e² + σd²) k-diffusion `soft-min-snr` (Crowson et al. 2024, HDiT)
  p2(k, γ)       SNR/(k + SNR)^γ      Choi et al. 2022 (eps-space 1/(k+SNR)^γ)
  speed(λ, τ)    SNR·CAW(t)           SpeeD change-aware weighting on the eps-MSE, 1 for t ≥ τ
  edm(σd)        (sigma_e² + σd²)/(sigma_e·σd)²   Karras et al. 2022, Eq. 8 / Table 1
  sd3_sigma_sqrt 1/s²                 diffusers `compute_loss_weighting_for_sd3("sigma_sqrt")`
  cosmap         2/(π(1 - 2s + 2s²))  diffusers `compute_loss_weighting_for_sd3("cosmap")`
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from . import prediction as P
from .schedule import NoiseSchedule


def _positive(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def speed_caw(schedule: NoiseSchedule, lam: float = 0.6, tau: int = 700) -> torch.Tensor:
    """SpeeD change-aware weighting on the eps-MSE, exactly as the official `weighting="ours"`:
    g = np.gradient(1 - ᾱ) over all T steps, w = (1-λ) + (2λ-1)·(g - min g)/(max g - min g) for
    t < τ and w = 1 for t ≥ τ (`speed/diffusion/speed/__init__.py`, `_weights`)."""
    if not 0 <= tau <= schedule.T:
        raise ValueError(f"tau must lie in [0, T={schedule.T}], got {tau!r}")
    g = np.gradient(schedule.sigma.cpu().numpy() ** 2)  # 1 - ᾱ = sigma² on VP schedules
    k = 1.0 - lam
    w = k + (1 - 2 * k) * (g - g.min()) / (g.max() - g.min())
    w[int(tau):] = 1.0
    return torch.from_numpy(w)


def _x0_weights(name: str, s: NoiseSchedule, prediction: str, args: dict) -> torch.Tensor:
    snr, sig = s.snr, s.sigma
    if name == "simple":
        return P.c_factor(prediction, s.alpha, s.sigma)
    if name == "constant":
        return torch.ones_like(snr)
    if name == "snr":
        return snr.clone()
    if name in ("min_snr", "max_snr"):
        gamma = _positive("gamma", args.get("gamma", 5.0))
        fn = torch.clamp_max if name == "min_snr" else torch.clamp_min
        return fn(snr, gamma)
    if name == "soft_min_snr":
        sd = _positive("sigma_data", args.get("sigma_data", 0.5))
        return snr / (1 + sd**2 * snr)  # = 1/(sigma_e² + σd²) with sigma_e² = 1/SNR
    if name == "p2":
        k = _positive("k", args.get("k", 1.0))
        gamma = float(args.get("gamma", 1.0))
        return snr / (k + snr) ** gamma
    if name == "speed":
        lam = float(args.get("lam", 0.6))
        if not 0.5 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0.5, 1] (weights in [1-λ, λ]), got {lam!r}")
        return speed_caw(s, lam, int(args.get("tau", 700))) * snr
    if name == "edm":
        sd = _positive("sigma_data", args.get("sigma_data", 0.5))
        return 1.0 / sd**2 + snr  # (sigma_e² + σd²)/(sigma_e σd)² with sigma_e² = 1/SNR
    if name == "sd3_sigma_sqrt":
        return sig ** -2.0
    if name == "cosmap":
        return 2.0 / (math.pi * (1 - 2 * sig + 2 * sig**2))
    raise ValueError(f"unknown weighting {name!r}; choose from {', '.join(WEIGHTINGS)}")


WEIGHTINGS = {
    "simple": (), "constant": (), "snr": (), "min_snr": ("gamma",), "max_snr": ("gamma",),
    "soft_min_snr": ("sigma_data",), "p2": ("k", "gamma"), "speed": ("lam", "tau"),
    "edm": ("sigma_data",), "sd3_sigma_sqrt": (), "cosmap": (),
}


def loss_weight(name: str, schedule: NoiseSchedule, prediction: str = "eps", **args) -> torch.Tensor:
    """[T] float64 weight on the MSE of `prediction` (see the module docstring)."""
    P.check(prediction)
    if name not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {name!r}; choose from {', '.join(WEIGHTINGS)}")
    unknown = set(args) - set(WEIGHTINGS[name])
    if unknown:
        raise ValueError(f"weighting {name!r} got unknown argument {sorted(unknown)[0]!r} "
                         f"(it takes: {', '.join(WEIGHTINGS[name]) or 'nothing'})")
    s = schedule.to("cpu")
    w_x0 = _x0_weights(name, s, prediction, args)
    if name == "simple":
        w = torch.ones_like(w_x0)
    else:
        w = w_x0 / P.c_factor(prediction, s.alpha, s.sigma)
    w = torch.where(s.snr == 0, torch.ones_like(w), w)  # SNR = 0 guard (Min-SNR PR #4)
    if not torch.isfinite(w).all():
        bad = int(torch.nonzero(~torch.isfinite(w))[0])
        raise ValueError(f"weighting {name!r} is not finite at t={bad} for this schedule")
    return w.to(schedule.device)


def effective_x0_weight(w: torch.Tensor, schedule: NoiseSchedule, prediction: str,
                        probs: torch.Tensor, iw: torch.Tensor | None = None) -> torch.Tensor:
    """p(t)·iw(t)·w(t)·c(t), the weight the objective puts on each timestep's x0-space MSE,
    scaled by T so that uniform sampling with the x0-MSE gives 1."""
    c = P.c_factor(prediction, schedule.alpha, schedule.sigma).to(w)
    c = torch.where(schedule.snr.to(w.device) == 0, torch.ones_like(c), c)
    iw = torch.ones_like(w) if iw is None else iw.to(w)
    return schedule.T * probs.to(w) * iw * w * c


class LearnedLogVarWeight(nn.Module):
    """EDM2-style learned per-timestep uncertainty (Karras et al. 2024, Eq. 21):
    L = w(t)/exp(u(t))·mse + u(t), with u(t) a linear map of Fourier features of ln(sigma_e)/4.
    Trains jointly with the model; `forward(t, mse)` returns the per-sample loss."""

    def __init__(self, schedule: NoiseSchedule, channels: int = 128, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels, generator=g), persistent=True)
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels, generator=g), persistent=True)
        c_noise = torch.log(torch.clamp(schedule.to("cpu").edm_sigma(), 1e-8, 1e8)) / 4
        self.register_buffer("c_noise", c_noise.float(), persistent=True)
        self.linear = nn.Linear(channels, 1, bias=False)
        nn.init.zeros_(self.linear.weight)  # u = 0: starts as the fixed weighting

    def logvar(self, t: torch.Tensor) -> torch.Tensor:
        x = self.c_noise[t][:, None] * self.freqs + self.phases
        return self.linear(torch.cos(x) * math.sqrt(2)).squeeze(-1)

    def forward(self, t: torch.Tensor, weighted_mse: torch.Tensor) -> torch.Tensor:
        u = self.logvar(t)
        return weighted_mse * torch.exp(-u) + u


def weighting_args(name: str) -> tuple[str, ...]:
    """Argument names a weighting accepts (used by the config validation)."""
    if name not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {name!r}; choose from {', '.join(WEIGHTINGS)}")
    return WEIGHTINGS[name]

