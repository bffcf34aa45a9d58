"""Single-step terms of the variational bound, as tables over the timestep.

For τ ≥ 1 (Ho et al. 2020, Eq. 5; improved-diffusion's `_vb_terms_bpd`) the term is
    L_τ = KL(q(x_{τ−1} | x_τ, x0) ‖ p_θ(x_{τ−1} | x_τ))  per dimension, in bits,
for a general schedule x_t = a_t·x0 + s_t·ε. Between steps t = τ and s = τ − 1 (Kingma et al. 2021,
VDM, Eq. 33): a_{t|s} = a_t/a_s, s²_{t|s} = s_t² − a_{t|s}²·s_s², and the posterior is Gaussian with
    mean  (a_{t|s}·s_s²/s_t²)·x_τ + (a_s·s²_{t|s}/s_t²)·x0,   variance  σ̃² = s²_{t|s}·s_s²/s_t².
The model's mean is the same expression with x̂0 in place of x0 (every prediction type reaches x̂0
through `DiffusionObjective.x0_hat`), and its variance is fixed:
    "large"  σ_p² = s²_{t|s}  (β_τ on a VP schedule; the official ATS config, ddpm-torch `fixed-large`)
    "small"  σ_p² = σ̃²        (the posterior variance; ddpm-torch `fixed-small`)
so the KL of two Gaussians per dimension is
    L_τ = coef[τ]·mean_d (x0 − x̂0)² + const[τ],
    coef  = ½·(a_s·s²_{t|s}/s_t²)² / σ_p² / ln 2       (fixed-small: ½·(SNR_s − SNR_t)/ln 2)
    const = ½·(ln(σ_p²/σ̃²) + σ̃²/σ_p² − 1) / ln 2       (0 for fixed-small).
Only coef depends on the mean, so under common random numbers (the same x_τ before and after an
update) L_τ(θ_k) − L_τ(θ_{k+1}) = coef[τ]·(mse_k − mse_{k+1}).

τ = 0 is the decoder term. Here it is the continuous Gaussian decoder of VDM (and of
`fasttrain.generation.evaluate.nelbo_bits_per_dim` with discrete=False): −log N(x0; x̂0, 1/SNR_0) per
dimension, i.e. coef = ½·SNR_0/ln 2, const = ½·ln(2π/SNR_0)/ln 2. The official code instead takes the
Gaussian KL at t = 0 with the variance clipped to the posterior variance of t = 1 (ddpm-torch
`posterior_logvar_clipped`), whose mean coefficient ½/σ̃²_1 is of the same order as ½·SNR_0
(linear schedule: 0.9e4 vs 0.5e4). The discretised 8-bit decoder is not used: its mean term is not a
weighted MSE, which the common-random-number difference above relies on.

Where a prediction type cannot recover x0 (eps at a step with a_t = 0: zero-terminal SNR, the last
flow step) the term is undefined; `valid` marks those steps and the probes skip them.
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidInput
from .schedule import NoiseSchedule

VARIANCES = ("large", "small")


def vlb_tables(schedule: NoiseSchedule, variance: str = "large") -> tuple[torch.Tensor, torch.Tensor]:
    """(coef, const), float64 [T] on the schedule's device: L_τ = coef[τ]·mean_d(x0 − x̂0)² + const[τ]."""
    if variance not in VARIANCES:
        raise InvalidInput(f"unknown model variance {variance!r}; choose from {', '.join(VARIANCES)}")
    a, s = schedule.alpha.double(), schedule.sigma.double()
    a_t, s_t, a_s, s_s = a[1:], s[1:], a[:-1], s[:-1]
    s2_ts = s_t**2 - (a_t / a_s) ** 2 * s_s**2          # s²_{t|s} (VDM Eq. 33)
    post_var = s2_ts * s_s**2 / s_t**2                  # σ̃²
    mean_x0 = a_s * s2_ts / s_t**2                      # coefficient of x0 in the posterior mean
    model_var = s2_ts if variance == "large" else post_var
    coef = 0.5 * mean_x0**2 / model_var
    const = 0.5 * (torch.log(model_var / post_var) + post_var / model_var - 1)
    snr0 = a[0] ** 2 / s[0] ** 2
    coef0 = (0.5 * snr0).reshape(1)
    const0 = (0.5 * torch.log(2 * math.pi / snr0)).reshape(1)
    return torch.cat([coef0, coef]) / math.log(2), torch.cat([const0, const]) / math.log(2)


def valid_steps(schedule: NoiseSchedule, defined: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [T]: steps where the network's x̂0 is defined (`Denoiser.x0_defined()`; all, without it)."""
    if defined is None:
        return torch.ones(schedule.T, dtype=torch.bool, device=schedule.device)
    return defined.to(torch.bool)
