"""Figures of a run (run.py) and of what the adaptive timestep sampler learned (adaptive.py)."""
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
