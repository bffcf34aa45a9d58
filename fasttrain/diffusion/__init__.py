"""The timestep core: schedules, prediction types, weightings, samplers, statistics, objective.

    from fasttrain import diffusion as fd
    s = fd.schedule("linear", T=1000)
    w = fd.loss_weight("min_snr", s, prediction="v", gamma=5.0)
    smp = fd.timestep_sampler("speed", s, k=5, tau=700, dual=True)
    t, iw = smp.sample(256, generator=g)

The modules, one concept each:
  `schedule`        NoiseSchedule (α, σ, SNR tables) and its builders; `from_config` (the run's schedule)
  `prediction`      prediction types (eps, x0, v, flow): targets, conversions, c(t)
  `weighting`       loss weights in x0 space; `debiased` and `timestep_bias` (ported weightings/samplers),
                    `flow_weighting` (diffusers' SD3/Flux weights on the velocity MSE)
  `samplers`        TimestepSampler and the plain samplers; `adaptive` + `policy` + `vlb` (the learned one)
  `stats`           TimestepStats (per-timestep statistics on the device)
  `objective`       Objective, DiffusionObjective, the OBJECTIVES registry, the kernel backend boundary
  `mixed`           mixed prediction (several heads and a gate): MixedObjective, MixedOutput
  `denoiser`        Denoiser (network + output head + learned log-variance + gate)
  `noise_options`   diffusion.noise → the kernels' noise options; `immiscible` (which noise each image gets)
  `loss_shapes`     diffusion.loss → the loss shape and its threshold table
  `lookahead`       the hook around the optimizer step (LookAhead, Probe, x0_mse, RankSplit)
  `interference`    the cross-timestep interference diagnostic; `variation` (the loss CV)
  `solvers`         generation solvers (DDPM, DDIM, Heun, flow); `nelbo` (bits/dim)
  `dynamic_shift`   FLUX.1-dev's resolution-dependent flow shift at sampling (mu, the shift, re-tabling)
  `align`           REPA-style representation alignment (diffusion.align): head, hooks, the added loss

Extension points are registries (fasttrain/registry.py): a prediction type, a weighting or a timestep
sampler is one module in this package that registers itself; every module here is imported below."""
from ..registry import discover as _discover
from . import prediction
from .objective import DiffusionObjective
from .prediction import PREDICTIONS_REGISTRY
from .samplers import SAMPLERS, TimestepSampler, timestep_sampler
from .schedule import SCHEDULES, NoiseSchedule, schedule
from .stats import TimestepStats
from .weighting import WEIGHTINGS, LearnedLogVar, effective_x0_weight, loss_weight, speed_caw

_discover(__name__)  # extensions in their own modules (adaptive.py, ...) register themselves

PREDICTIONS = PREDICTIONS_REGISTRY.names()

__all__ = [
    "prediction", "PREDICTIONS", "SCHEDULES", "NoiseSchedule", "schedule", "WEIGHTINGS", "LearnedLogVar",
    "effective_x0_weight", "loss_weight", "speed_caw", "SAMPLERS", "TimestepSampler", "timestep_sampler",
    "TimestepStats", "DiffusionObjective",
]
