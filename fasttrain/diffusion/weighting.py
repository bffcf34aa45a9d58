"""Loss weightings, each defined on the x0-space MSE and converted to the prediction's space.

`loss_weight(name, schedule, prediction, **args)` returns a float64 [T] table w such that the
training loss is w[t]·mean((pred - target)²). Every weighting is an x0-space weight w_x0(t),
registered as a function of the schedule, and w = w_x0 / c(t) (prediction.c_factor), so the
*effective* x0-space weight p(t)·iw(t)·w(t)·c(t) of a strategy does not depend on the prediction
type (Hang et al. 2023, §4 and appendix). A new weighting is one registered function.

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

from ..errors import InvalidInput
from ..registry import Registry
from . import prediction as P
from .schedule import NoiseSchedule

WEIGHTINGS = Registry("weighting", positional=2)  # fn(schedule, prediction, **args) -> x0-space [T]
register = WEIGHTINGS.register


def _positive(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise InvalidInput(f"{name} must be a positive number, got {value!r}")
    return float(value)


@register("simple")
def simple(s: NoiseSchedule, prediction: str):
    return P.c_factor(prediction, s.alpha, s.sigma)


@register("constant")
def constant(s, prediction):
    return torch.ones_like(s.snr)


@register("snr")
def snr(s, prediction):
    return s.snr.clone()


@register("min_snr")
def min_snr(s, prediction, gamma: float = 5.0):
    return torch.clamp_max(s.snr, _positive("gamma", gamma))


@register("max_snr")
def max_snr(s, prediction, gamma: float = 5.0):
    return torch.clamp_min(s.snr, _positive("gamma", gamma))


@register("soft_min_snr")
def soft_min_snr(s, prediction, sigma_data: float = 0.5):
    sd = _positive("sigma_data", sigma_data)
    return s.snr / (1 + sd**2 * s.snr)  # = 1/(sigma_e² + σd²) with sigma_e² = 1/SNR


@register("p2")
def p2(s, prediction, k: float = 1.0, gamma: float = 1.0):
    return s.snr / (_positive("k", k) + s.snr) ** float(gamma)


def speed_caw(schedule: NoiseSchedule, lam: float = 0.6, tau: int = 700) -> torch.Tensor:
    """SpeeD change-aware weighting on the eps-MSE, exactly as the official `weighting="ours"`:
    g = np.gradient(1 - ᾱ) over all T steps, w = (1-λ) + (2λ-1)·(g - min g)/(max g - min g) for
    t < τ and w = 1 for t ≥ τ (`speed/diffusion/speed/__init__.py`, `_weights`)."""
    if not 0 <= tau <= schedule.T:
        raise InvalidInput(f"tau must lie in [0, T={schedule.T}], got {tau!r}")
    g = np.gradient(schedule.sigma.cpu().numpy() ** 2)  # 1 - ᾱ = sigma² on VP schedules
    k = 1.0 - lam
    w = k + (1 - 2 * k) * (g - g.min()) / (g.max() - g.min())
    w[int(tau):] = 1.0
    return torch.from_numpy(w)


@register("speed")
def speed(s, prediction, lam: float = 0.6, tau: int = 700):
    if not 0.5 <= lam <= 1.0:
        raise InvalidInput(f"lam must lie in [0.5, 1] (weights in [1-λ, λ]), got {lam!r}")
    return speed_caw(s, lam, int(tau)) * s.snr


@register("edm")
def edm(s, prediction, sigma_data: float = 0.5):
    sd = _positive("sigma_data", sigma_data)
    return 1.0 / sd**2 + s.snr  # (sigma_e² + σd²)/(sigma_e σd)² with sigma_e² = 1/SNR


@register("sd3_sigma_sqrt")
def sd3_sigma_sqrt(s, prediction):
    return s.sigma ** -2.0


@register("cosmap")
def cosmap(s, prediction):
    return 2.0 / (math.pi * (1 - 2 * s.sigma + 2 * s.sigma**2))


def loss_weight(name: str, schedule: NoiseSchedule, prediction: str = "eps", **args) -> torch.Tensor:
    """[T] float64 weight on the MSE of `prediction` (see the module docstring)."""
    P.check(prediction)
    WEIGHTINGS.check_args(name, args)
    s = schedule.to("cpu")
    w_x0 = WEIGHTINGS.get(name)(s, prediction, **args)
    w = w_x0 / P.c_factor(prediction, s.alpha, s.sigma)
    w = torch.where(s.snr == 0, torch.ones_like(w), w)  # SNR = 0 guard (Min-SNR PR #4)
    if not torch.isfinite(w).all():
        bad = int(torch.nonzero(~torch.isfinite(w))[0])
        raise InvalidInput(f"weighting {name!r} is not finite at t={bad} for this schedule")
    return w.to(schedule.device)


def effective_x0_weight(w: torch.Tensor, schedule: NoiseSchedule, prediction: str,
                        probs: torch.Tensor, iw: torch.Tensor | None = None) -> torch.Tensor:
    """p(t)·iw(t)·w(t)·c(t), the weight the objective puts on each timestep's x0-space MSE,
    scaled by T so that uniform sampling with the x0-MSE gives 1."""
    c = P.c_factor(prediction, schedule.alpha, schedule.sigma).to(w)
    c = torch.where(schedule.snr.to(w.device) == 0, torch.ones_like(c), c)
    iw = torch.ones_like(w) if iw is None else iw.to(w)
    return schedule.T * probs.to(w) * iw * w * c


LOGVAR_LAYERS = ("linear", "edm2")


def mp_normalize(w: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """EDM2's `normalize` (networks_edm2.py, Eq. 66): each output row scaled to unit RMS per element."""
    norm = torch.linalg.vector_norm(w, dim=list(range(1, w.ndim)), keepdim=True, dtype=torch.float32)
    return w / (eps + norm * (norm.numel() / w.numel()) ** 0.5).to(w.dtype)


class LearnedLogVar(nn.Module):
    """EDM2's learned per-noise-level uncertainty (Karras et al. 2024, Eq. 21 and `Precond.logvar`):
    L = w(t)/exp(u(t))·mse + u(t), with u(t) a linear map of Fourier features of c_noise = ln(sigma_e)/4
    (EDM2's MPFourier, Eq. 75: sqrt(2)·cos(c_noise·freqs + phases), freqs = 2π·N(0, 1), phases = 2π·U[0, 1),
    fixed buffers). It is a part of the network (see `Denoiser`), so it is sharded, reduced, averaged
    and checkpointed like every other weight.

      layer=linear  an nn.Linear initialised at zero: u = 0 at start, the fixed weighting (fasttrain's
                    original form)
      layer=edm2    EDM2's MPConv(128 → 1): a randomly initialised weight (randn, from this module's own
                    seed, so the backbone's initial weights do not move), forced weight normalization in
                    training (the stored weight is renormalised before every use, Eq. 66) and the
                    magnitude-preserving 1/sqrt(fan_in) scale (Eq. 47); u starts as a random smooth
                    function of the noise level, as in EDM2. Computed in fp32 under any autocast."""

    def __init__(self, schedule: NoiseSchedule, channels: int = 128, seed: int = 0, layer: str = "linear"):
        super().__init__()
        if layer not in LOGVAR_LAYERS:
            raise InvalidInput(f"unknown log-variance layer {layer!r}; choose from {', '.join(LOGVAR_LAYERS)}")
        self.layer = layer
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels, generator=g), persistent=True)
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels, generator=g), persistent=True)
        c_noise = torch.log(torch.clamp(schedule.to("cpu").edm_sigma(), 1e-8, 1e8)) / 4
        self.register_buffer("c_noise", c_noise.float(), persistent=True)
        if layer == "linear":
            self.linear = nn.Linear(channels, 1, bias=False)
            nn.init.zeros_(self.linear.weight)
        else:
            self.weight = nn.Parameter(torch.randn(1, channels, generator=g))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        with torch.autocast(t.device.type, enabled=False):  # EDM2 computes u in fp32
            x = torch.cos(self.c_noise[t][:, None] * self.freqs + self.phases) * math.sqrt(2)
            if self.layer == "linear":
                return self.linear(x).squeeze(-1)
            w = self.weight.float()
            if self.training:  # forced weight normalization: the stored weight stays at unit RMS
                with torch.no_grad():
                    self.weight.copy_(mp_normalize(w))
            w = mp_normalize(w) / math.sqrt(w.shape[1])  # magnitude-preserving: unit-norm row
            return (x.float() @ w.t()).squeeze(-1)


def uncertainty_loss(weighted_mse: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """EDM2 Eq. 21 per sample: w·mse/exp(u) + u."""
    return weighted_mse * torch.exp(-logvar.float()) + logvar.float()
