"""Figures: `run.py` (a run's loss curve, per-timestep statistics, evaluation curves, sample grids),
`adaptive.py` (what the adaptive timestep sampler learned), `common.py` (their shared style and saving)."""
from .adaptive import plot_adaptive
from .run import (
                  plot_eval_curves,
                  plot_interference,
                  plot_loss_curve,
                  plot_points,
                  plot_run,
                  plot_timesteps,
                  save_samples,
)

__all__ = ["plot_adaptive", "plot_eval_curves", "plot_interference", "plot_loss_curve", "plot_points", "plot_run",
           "plot_timesteps", "save_samples"]
