"""Checkpoints every `train.ckpt_every` steps (last.pt or the DCP folder: checkpoint/), written only from
a good state: never over last.pt from a state whose last steps were not finite or whose weights are not
(finite weights whose output on a probe is finite), so the previous last.pt stays the one to resume
from. The trainer also saves through it when a signal stops the run and when the run ends."""
from __future__ import annotations

import sys

import torch

from . import Periodic, register


@register("checkpoint")
class Checkpoint(Periodic):
    order = 40
    reads = ("state", "step", "model", "spec", "objective", "checkpoints", "dist", "device")
    saves = ("last.pt", "dcp/")
    pauses_clock = True
    final = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every = cfg.train.ckpt_every

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, run) -> None:
        if int(run.state.skipped_run) > 0 or not weights_work(run):
            if run.dist.is_main:
                kept = "the previous last.pt is kept" if run.checkpoints.latest() else "no checkpoint is written"
                print(f"fasttrain: not saving at step {run.step}: the last steps were not finite ({kept})",
                      file=sys.stderr)
            return
        run.checkpoints.save()


def weights_work(run) -> bool:
    """Finite weights whose output is finite on a probe (the last update could have made them huge but
    finite: the next step's loss would tell, the checkpoint must not wait for it)."""
    model = run.model
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return False
    x = torch.zeros((2,) + run.spec.shape, device=run.device)
    t = torch.full((2,), run.objective.T // 2, device=run.device, dtype=torch.long)
    model.eval()
    try:
        with torch.no_grad():
            out = model(x, t)
    finally:
        model.train()
    return bool(torch.isfinite(out).all())
