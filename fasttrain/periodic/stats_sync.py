"""The statistics sync: every `diffusion.stats_every` steps the per-timestep statistics of every rank
are all-reduced and whoever learns from them (the timestep sampler, the output head: mixed argmin)
observes them (objective.sync_stats). Part of the optimizer step's bookkeeping (`in_step`): no host read
with one process; across ranks the collectives of the statistics (docs/architecture.md, "Host reads")."""
from __future__ import annotations

from . import Periodic, register


@register("stats_sync")
class StatsSync(Periodic):
    order = 10
    reads = ("objective",)
    saves = ()  # the statistics are the objective's checkpoint state
    in_step = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every = cfg.diffusion.stats_every

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0

    def __call__(self, run) -> None:
        run.objective.sync_stats()
