"""The loss shape of a run (`diffusion.loss`): the per-element ρ of the loss kernels (kernels/loss_shape.py:
l2, l1, huber, smooth_l1, pseudo_huber) and the Huber family's threshold schedule c(t), a [T] table that
the kernels gather by t like the weights (Khrapov & Popov 2024, "Improving Diffusion Models's
Data-Corruption Resistance using Scheduled Pseudo-Huber Loss", arXiv 2403.16728; as sd-scripts'
train_util.get_huber_threshold_if_needed and diffusers' research_projects/scheduled_huber_loss_training):

  constant     c = huber_c·huber_scale
  exponential  c = huber_scale·exp(−(−ln huber_c / T)·t)     (= huber_scale·huber_c^(t/T): 1 → huber_c)
  snr          c = (1 − huber_c)/(1 + σ_t/α_t)² + huber_c    (sd-scripts' sigma = √((1 − ᾱ)/ᾱ) = σ/α; → 1 at
                                                              low noise, → huber_c at high noise; huber_scale
                                                              is not applied here, as in sd-scripts)
Defaults are the sources': l2, huber_c 0.1, huber_scale 1, schedule snr. Where they disagree: diffusers has
no huber_scale (= 1) and no l1, and draws one timestep per batch with a Huber loss (a float c);
sd-scripts (since 2024-09) and fasttrain draw t per sample, so c is per sample. diffusers' LCM scripts
use pseudo_huber with c = 0.001 and no schedule: `loss.type=pseudo_huber loss.huber_c=0.001
loss.huber_schedule=constant`.

For mixed prediction the shape applies to every squared residual of its objective: the x0-space main
term and each head's own-space aux term (kernels/torch_ref_mixed_loss.py).
"""
from __future__ import annotations

import math

import torch

from fasttrain.kernels.loss_shape import LOSSES

from ..errors import InvalidInput
from .schedule import NoiseSchedule

HUBER_SCHEDULES = ("constant", "exponential", "snr")


def check(loss: str, huber_c: float, huber_scale: float, huber_schedule: str) -> None:
    if loss not in LOSSES:
        raise InvalidInput(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
    if huber_schedule not in HUBER_SCHEDULES:
        raise InvalidInput(f"unknown huber_schedule {huber_schedule!r}; choose from {', '.join(HUBER_SCHEDULES)}")
    for name, v in (("huber_c", huber_c), ("huber_scale", huber_scale)):
        if not (math.isfinite(float(v)) and float(v) > 0):
            raise InvalidInput(f"{name} must be a finite number > 0, got {v!r}")


def huber_threshold(schedule: NoiseSchedule, huber_c: float = 0.1, huber_scale: float = 1.0,
                    huber_schedule: str = "snr") -> torch.Tensor:
    """c(t), float64 [T] on the schedule's device (module docstring)."""
    check("huber", huber_c, huber_scale, huber_schedule)
    T = schedule.T
    t = torch.arange(T, dtype=torch.float64, device=schedule.device)
    if huber_schedule == "constant":
        return torch.full_like(t, huber_c * huber_scale)
    if huber_schedule == "exponential":
        return torch.exp(-(-math.log(huber_c) / T) * t) * huber_scale
    sigma = schedule.sigma.double() / schedule.alpha.double()  # inf at a zero-terminal step: c = huber_c
    return (1 - huber_c) / (1 + sigma) ** 2 + huber_c


class LossShape:
    """What the objective passes the loss ops: the shape's name and its float32 c(t) (None without one)."""

    def __init__(self, schedule: NoiseSchedule, loss: str = "l2", huber_c: float = 0.1, huber_scale: float = 1.0,
                 huber_schedule: str = "snr"):
        check(loss, huber_c, huber_scale, huber_schedule)
        self.loss = loss
        self.c_table = (huber_threshold(schedule, huber_c, huber_scale, huber_schedule).float()
                        if loss in ("huber", "smooth_l1", "pseudo_huber") else None)

    @classmethod
    def from_config(cls, schedule: NoiseSchedule, cfg) -> LossShape:
        return cls(schedule, cfg.type, cfg.huber_c, cfg.huber_scale, cfg.huber_schedule)
