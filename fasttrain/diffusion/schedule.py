"""Discrete noise schedules: x_t = alpha[t]·x0 + sigma[t]·eps for t = 0..T-1.

Every per-timestep quantity in fasttrain is a length-T float64 table that kernels gather by `t`.
VP schedules (linear, scaled_linear, cosine, quad) have alpha² + sigma² = 1 with alpha = sqrt(ᾱ_t);
`flow` is rectified flow (alpha = 1 - s, sigma = s) on the grid s_t = (t+1)/T; with `shift` ≠ 1 the grid
is shifted as SD3 trains and samples it (Esser et al. 2024, "Scaling Rectified Flow Transformers", Eq. 23;
diffusers' FlowMatchEulerDiscreteScheduler): σ_t = shift·s_t / (1 + (shift − 1)·s_t), alpha = 1 − σ_t.
Every table (alpha, sigma, snr) follows, so every weighting, timestep sampler, solver and kernel does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidInput

SCHEDULES = ("linear", "scaled_linear", "cosine", "quad", "flow")


@dataclass(frozen=True)
class NoiseSchedule:
    name: str
    alpha: torch.Tensor  # float64 [T]
    sigma: torch.Tensor  # float64 [T]
    shift: float = 1.0   # the flow schedule's time shift (1: plain rectified flow)

    @property
    def T(self) -> int:
        return self.alpha.numel()

    @property
    def snr(self) -> torch.Tensor:
        """SNR_t = alpha²/sigma² (float64; inf where sigma = 0, 0 at a zero-terminal step)."""
        return self.alpha**2 / self.sigma**2

    @property
    def is_vp(self) -> bool:
        return self.name != "flow"

    @property
    def alphas_cumprod(self) -> torch.Tensor:
        """ᾱ_t = alpha_t² for VP schedules."""
        return self.alpha**2

    @property
    def device(self) -> torch.device:
        return self.alpha.device

    def to(self, device) -> NoiseSchedule:
        return NoiseSchedule(self.name, self.alpha.to(device), self.sigma.to(device), self.shift)

    def edm_sigma(self) -> torch.Tensor:
        """Noise level in EDM/VE units, sigma/alpha = SNR^-1/2 (inf at a zero-terminal step)."""
        return self.sigma / self.alpha

    def log_sigma_edges(self) -> torch.Tensor:
        """[T-1] midpoints between consecutive ln sigma_e (increasing in t): the cell boundaries of
        `nearest_timestep`, also used for the exact marginal of samplers drawn in ln sigma_e."""
        log_sig = -0.5 * torch.log(self.snr)  # +inf at a zero-terminal step
        return ((log_sig[1:] + log_sig[:-1]) / 2).contiguous()

    def nearest_timestep(self, log_sigma_e: torch.Tensor, edges: torch.Tensor | None = None) -> torch.Tensor:
        """The timestep whose ln sigma_e is nearest to each value (the one place that maps continuous
        EDM noise levels onto this discrete schedule: lognormal training sampler, Heun's step grid)."""
        edges = self.log_sigma_edges().to(log_sigma_e.device) if edges is None else edges
        return torch.searchsorted(edges, log_sigma_e.to(edges.dtype).contiguous())


def _betas(name: str, T: int) -> np.ndarray:
    if name == "linear":
        # iDDPM `get_named_beta_schedule("linear")`: 1e-4 → 0.02 scaled by 1000/T.
        scale = 1000.0 / T
        return np.linspace(scale * 1e-4, scale * 0.02, T, dtype=np.float64)
    if name == "scaled_linear":
        # Stable Diffusion: linear in sqrt(beta) from 0.00085 to 0.012.
        return np.linspace(0.00085**0.5, 0.012**0.5, T, dtype=np.float64) ** 2
    if name == "quad":
        # ddpm-torch "quad" (used by the adaptive timestep sampler): linear in sqrt(beta), 1e-4 → 0.02.
        return np.linspace(1e-4**0.5, 0.02**0.5, T, dtype=np.float64) ** 2
    if name == "cosine":
        # Nichol & Dhariwal 2021, Eq. 17 with s = 0.008 and betas clipped at 0.999.
        def abar(u):
            return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

        return np.array([min(1 - abar((i + 1) / T) / abar(i / T), 0.999) for i in range(T)], dtype=np.float64)
    raise InvalidInput(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")


def _zero_terminal_snr(alpha: np.ndarray) -> np.ndarray:
    """Lin et al. 2024 (Common Diffusion Noise Schedules are Flawed), Algorithm 1: shift and scale
    sqrt(ᾱ) so that the last step has SNR = 0 while the first step keeps its value."""
    a0, aT = alpha[0], alpha[-1]
    return (alpha - aT) * a0 / (a0 - aT)


def shifted(s, shift: float):
    """SD3's time shift of a flow noise level (Esser et al. 2024, Eq. 23): shift·s / (1 + (shift − 1)·s);
    it keeps s = 0 and s = 1 and, for shift > 1, moves the levels between towards noise."""
    return shift * s / (1.0 + (shift - 1.0) * s)


def schedule(name: str = "linear", T: int = 1000, zero_terminal_snr: bool = False,
             shift: float = 1.0) -> NoiseSchedule:
    """Build a schedule by name; tables are float64 CPU tensors (use `.to(device)` to move them).
    `shift`: the flow schedule's time shift (SD3: 3.0); other schedules take only 1."""
    if not isinstance(T, int) or T < 2:
        raise InvalidInput(f"T must be an integer >= 2, got {T!r}")
    shift = float(shift)
    if not (shift > 0 and shift < float("inf")):
        raise InvalidInput(f"the flow shift must be a finite number > 0, got {shift!r}")
    if shift != 1.0 and name != "flow":
        raise InvalidInput(f"a time shift ({shift}) applies to the flow schedule only, not {name!r}")
    if name == "flow":
        s = (np.arange(T, dtype=np.float64) + 1.0) / T  # s_{T-1} = 1: pure noise, SNR = 0 already
        s = shifted(s, shift) if shift != 1.0 else s
        alpha, sigma = 1.0 - s, s
    else:
        betas = _betas(name, T)
        if not ((betas > 0) & (betas < 1)).all():
            raise InvalidInput(f"schedule {name!r} with T={T} gives betas outside (0, 1); use a larger T")
        abar = np.cumprod(1.0 - betas)
        alpha = np.sqrt(abar)
        if zero_terminal_snr:
            alpha = _zero_terminal_snr(alpha)
        sigma = np.sqrt(1.0 - alpha**2)
    return NoiseSchedule(name, torch.from_numpy(np.ascontiguousarray(alpha)),
                         torch.from_numpy(np.ascontiguousarray(sigma)), shift)


def from_config(df) -> NoiseSchedule:
    """The run's schedule from its `diffusion` section (schedule, T, zero_terminal_snr, flow_shift): the one
    place a run's schedule is built (the network, the objective, the bundle and the config check read it)."""
    return schedule(df.schedule, df.T, df.zero_terminal_snr, df.flow_shift)
