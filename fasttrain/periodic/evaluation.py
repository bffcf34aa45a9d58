"""Evaluation every `eval.every` steps before the last (the end of the run evaluates once more, in
Trainer.finish), and with `eval.at_start` once before the first step (where every curve starts):
FID/KID, the digits judge, bits/dim of the EMA model against the run's reference data (evaluate.py), on
every rank (FSDP forwards are collective); the metrics go to the log as eval/*."""
from __future__ import annotations

from . import Periodic, register


@register("evaluation")
class Evaluation(Periodic):
    order = 50
    reads = ("evaluate", "log", "step", "images")
    saves = ("metrics.jsonl",)
    pauses_clock = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every, self.at_start = cfg.eval.every, cfg.eval.at_start

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every) and step % self.every == 0 and not last

    def start(self, run) -> None:
        if self.every and self.at_start and run.step == 0:  # the initial network (not again on a resume)
            self(run)

    def __call__(self, run) -> None:
        log_metrics(run.log, run.step, run.images, run.evaluate())


def log_metrics(log, step: int, images: int, metrics: dict) -> dict:
    """An evaluation's metrics as the log's eval/* entries at this step (the end of a run logs its own too)."""
    log.log(step, images=images, **{f"eval/{k}": v for k, v in metrics.items()})
    return metrics
