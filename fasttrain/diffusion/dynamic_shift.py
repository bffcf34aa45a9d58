"""The resolution-dependent flow shift of a FlowMatchEulerDiscreteScheduler with `use_dynamic_shifting`
(FLUX.1-dev), at sampling (`diffusion.dynamic_shift`):

    mu    = m·n + b,  m = (max_shift − base_shift)/(max_image_seq_len − base_image_seq_len),
            b = base_shift − m·base_image_seq_len,  n the image's packed tokens  (FluxPipeline.calculate_shift)
    σ'(s) = e^mu / (e^mu + (1/s − 1))        time_shift_type exponential (the scheduler's time_shift)
          = mu / (mu + (1/s − 1))            linear

Both are SD3's shift σ' = k·s/(1 + (k − 1)·s) with k = e^mu (or mu): divide numerator and denominator by s. So
the shifted sampling schedule is fasttrain's flow schedule with `shift = k`, on the same unshifted grid
s = (t + 1)/T (FluxPipeline's default sigmas, linspace(1, 1/n, n), are fasttrain's trailing grid when n divides
T). Training is not shifted by it: the scheduler's training sigmas are unshifted under dynamic shifting, and
diffusers' train_dreambooth_lora_flux.py trains on them (scheduler_config.py).

`retabled(net, schedule)` makes a Denoiser sample on another flow schedule inside a block: its output head's
α/σ tables (the flow output → x̂0 conversion) and the backbone's time input (`use_flow_sigma`) read the
shifted table; both are restored after.
"""
from __future__ import annotations

import contextlib
import math

from .denoiser import PredictionOutput


def tokens(latent_side: int) -> int:
    """The packed image tokens of a square latent: 2×2 patches (FluxPipeline: latents.shape[1])."""
    return (latent_side // 2) ** 2


def mu(n: int, dyn) -> float:
    """FluxPipeline's calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)."""
    m = (dyn.max_shift - dyn.base_shift) / (dyn.max_image_seq_len - dyn.base_image_seq_len)
    return n * m + (dyn.base_shift - m * dyn.base_image_seq_len)


def shift_at(n: int, dyn) -> float:
    """The SD3-form shift k equal to the scheduler's time shift at `n` packed image tokens."""
    value = mu(n, dyn)
    return math.exp(value) if dyn.time_shift_type == "exponential" else value


@contextlib.contextmanager
def retabled(net, schedule):
    """Inside the block the Denoiser `net` converts its flow output with `schedule`'s tables and its
    backbone takes `schedule`'s σ as time input (module docstring)."""
    head = net.output
    if not isinstance(head, PredictionOutput) or head.prediction != "flow":
        raise ValueError("a dynamic shift at sampling needs a flow-prediction network")
    fresh = PredictionOutput("flow", schedule).to(head.alpha.device)
    names = ("alpha", "sigma", "coef", "defined")
    old = {k: getattr(head, k) for k in names}
    backbones = [m for m in net.modules() if hasattr(m, "use_flow_sigma")]
    tables = []
    try:
        for k in names:
            setattr(head, k, getattr(fresh, k))
        for m in backbones:
            tables.append(m.use_flow_sigma(schedule.sigma))
        yield
    finally:
        for k, v in old.items():
            setattr(head, k, v)
        for m, table in zip(backbones, tables):
            m.use_flow_sigma(table)
