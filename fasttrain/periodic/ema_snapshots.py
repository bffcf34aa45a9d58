"""Post-hoc EMA snapshots every `phema.every` steps and at the last step (EDM2 §3: the power-function EMA
profiles of optim/phema.py written to RUN/phema/, checkpoint/snapshots.py), from which `fasttrain ema`
reconstructs the EMA of any length. Ordered before the checkpoint: a checkpoint at a step always has that
step's snapshot beside it, so a resumed run never lacks one; a resumed run first removes the snapshots
after its step and the stopped invocation's last one off the grid, so that it ends with the snapshots
of the run that never stopped (checkpoint/snapshots.py `remove_after`)."""
from __future__ import annotations

from . import Periodic, register


@register("ema_snapshots")
class EMASnapshots(Periodic):
    order = 35
    reads = ("phema", "step", "checkpoints", "dist", "run_dir")
    saves = ("phema/",)
    pauses_clock = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every = cfg.phema.every

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every) and (step % self.every == 0 or last)

    def start(self, run) -> None:
        if self.every and run.dist.is_main:
            from ..checkpoint import snapshots

            snapshots.remove_after(run.run_dir, run.step, self.every)

    def __call__(self, run) -> None:
        from ..checkpoint import snapshots

        meta = {k: v for k, v in run.checkpoints.meta.items() if k in ("config", "data_spec", "lora")}
        snapshots.save(run.run_dir, run.phema, run.step, run.phema.images, meta, run.dist)
