"""The timestep core: schedules, prediction types, weightings, samplers, statistics, objective.

    from fasttrain import diffusion as fd
    s = fd.schedule("linear", T=1000)
    w = fd.loss_weight("min_snr", s, prediction="v", gamma=5.0)
    smp = fd.timestep_sampler("speed", s, k=5, tau=700, dual=True)
    t, iw = smp.sample(256, generator=g)
"""
from . import prediction
from .prediction import PREDICTIONS
from .schedule import SCHEDULES, NoiseSchedule, schedule
from .weighting import WEIGHTINGS, LearnedLogVarWeight, effective_x0_weight, loss_weight, speed_caw
from .samplers import SAMPLERS, TimestepSampler, timestep_sampler
from .stats import TimestepStats
from .objective import DiffusionObjective

__all__ = [
    "prediction", "PREDICTIONS", "SCHEDULES", "NoiseSchedule", "schedule", "WEIGHTINGS",
    "LearnedLogVarWeight", "effective_x0_weight", "loss_weight", "speed_caw", "SAMPLERS",
    "TimestepSampler", "timestep_sampler", "TimestepStats", "DiffusionObjective",
]
