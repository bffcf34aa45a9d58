"""The negative ELBO in bits per dimension, in improved-diffusion's convention (`calc_bpd_loop`), so
that the number compares with published bits/dim.

With the reverse variance set to the posterior variance (improved-diffusion's fixed-small variance;
Ho et al. 2020, Eq. 5; per-step form Kingma et al. 2021, VDM Eq. 13):
    L_i = ½·(SNR_{i-1} − SNR_i)·‖x0 − x̂0(x_i, i)‖²                 i = 1 .. T-1
    prior    KL(q(x_{T-1} | x0) ‖ N(0, I))
    decoder  −log p(x0 | x_0) with mean x̂0(x_0, 0). Images: variance β̃_1, the posterior variance
             between steps 1 and 0 (improved-diffusion clips the t = 0 posterior variance to its t = 1
             value: `posterior_log_variance_clipped`), discretized to 256 levels on [-1, 1] (Ho et al.
             2020, Eq. 13). Continuous data (no published convention): a Gaussian density with the
             variance of x_0 itself, 1/SNR_0 (VDM's p(x | z_0)).
For a general schedule x_t = a_t·x0 + s_t·eps the posterior variance between steps t > s is
s²_{t|s}·s_s²/s_t² with s²_{t|s} = s_t² − (a_t/a_s)²·s_s² (VDM Eq. 33); on VP schedules β̃_1 =
β_1·(1 − ᾱ_0)/(1 − ᾱ_1). The sum over i is estimated from `n_t` stratified timesteps per sample; the
result carries the standard error of the mean over samples, which includes that estimate's noise.
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidInput
from .schedule import NoiseSchedule


def log_discretized_gaussian(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) of 8-bit data in [-1, 1] under a Gaussian integrated over each bin of width 2/255,
    the edge bins extending to ±inf (Ho et al. 2020, Eq. 13)."""
    inv = torch.exp(-log_scale)
    upper = torch.special.ndtr(inv * (x - mean + 1 / 255))
    lower = torch.special.ndtr(inv * (x - mean - 1 / 255))
    p = torch.where(x < -0.999, upper, torch.where(x > 0.999, 1 - lower, upper - lower))
    return torch.log(p.clamp_min(1e-12))


def decoder_variance(schedule: NoiseSchedule, discrete: bool = True) -> torch.Tensor:
    """β̃_1, the posterior variance between steps 1 and 0, for images; 1/SNR_0 for continuous data
    (see the module docstring)."""
    a0, a1, s0, s1 = schedule.alpha[0], schedule.alpha[1], schedule.sigma[0], schedule.sigma[1]
    if not discrete:
        return s0**2 / a0**2
    return (s1**2 - (a1 / a0) ** 2 * s0**2) * s0**2 / s1**2


@torch.no_grad()
def nelbo_bits_per_dim(x0_hat, schedule: NoiseSchedule, x0: torch.Tensor, *, labels=None, n_t: int | None = None,
                       discrete: bool = True, generator: torch.Generator | None = None, batch_size: int = 512) -> dict:
    """Per-dimension negative ELBO of x0 in bits: mean over samples, its standard error, and the three
    parts. `x0_hat(x_t, t, labels) -> x̂0` is the trained network's estimate (bundle.py)."""
    T, dev = schedule.T, x0.device
    if T < 2:
        raise InvalidInput("the NELBO needs T >= 2")
    sch = schedule.to(dev)
    alpha, sigma, snr = sch.alpha, sch.sigma, sch.snr
    snr_prev = torch.cat([snr[:1], snr[:-1]])  # SNR_{i-1}; unused at i = 0
    log_scale = 0.5 * torch.log(decoder_variance(sch, discrete))
    D = x0[0].numel()
    parts = {"prior": [], "diffusion": [], "decoder": []}
    for lo in range(0, len(x0), batch_size):
        xb = x0[lo:lo + batch_size].double()
        yb = None if labels is None else labels[lo:lo + batch_size]
        B = len(xb)
        flat = xb.flatten(1)
        col = (-1,) + (1,) * (xb.ndim - 1)

        def err_at(t, xb=xb, yb=yb, col=col):  # this batch's (called within the iteration)
            eps = torch.randn(xb.shape, generator=generator, device=dev, dtype=torch.float64)
            xt = alpha[t].view(col) * xb + sigma[t].view(col) * eps
            return xb - x0_hat(xt.float(), t, yb).double()

        a_T, s_T = alpha[-1], sigma[-1]
        parts["prior"].append(0.5 * (s_T**2 + a_T**2 * flat**2 - 1 - torch.log(s_T**2)).sum(1))
        steps = T - 1
        k = steps if n_t is None else min(n_t, steps)
        total = torch.zeros(B, dtype=torch.float64, device=dev)
        for j in range(k):
            if n_t is None:
                i = torch.full((B,), j + 1, device=dev)
            else:
                u = (j + torch.rand(B, generator=generator, device=dev, dtype=torch.float64)) / k
                i = 1 + (u * steps).long().clamp(max=steps - 1)
            total += 0.5 * (snr_prev[i] - snr[i]) * err_at(i).flatten(1).pow(2).sum(1)
        parts["diffusion"].append(total * steps / k)
        resid = err_at(torch.zeros(B, dtype=torch.long, device=dev))  # x0 - x̂0 at step 0
        if discrete:
            ll = log_discretized_gaussian(xb, xb - resid, log_scale.expand_as(xb))
        else:
            ll = -0.5 * (resid**2 * torch.exp(-2 * log_scale) + math.log(2 * math.pi) + 2 * log_scale)
        parts["decoder"].append(-ll.flatten(1).sum(1))
    to_bits = 1.0 / (D * math.log(2))
    per = {k: torch.cat(v) * to_bits for k, v in parts.items()}
    total = per["prior"] + per["diffusion"] + per["decoder"]
    n = total.numel()
    out = {k: float(v.mean()) for k, v in per.items()}
    out["bpd"] = float(total.mean())
    out["bpd_se"] = float(total.std() / math.sqrt(n)) if n > 1 else float("nan")
    return out
