"""The alignment loss (REPA, diffusion/align.py) every `train.log_every` steps and at the last step: the
mean −cos of the head's tokens and the encoder's since the last line (one all-reduce across ranks), as
`align/loss` in metrics.jsonl and TensorBoard, a line of its own beside the log action's (the diffusion
loss's line stays what it is)."""
from __future__ import annotations

from . import Periodic, register


@register("align_log")
class AlignLog(Periodic):
    order = 21  # right after the log line of the same step
    reads = ("alignment", "log", "step", "images")
    saves = ("metrics.jsonl", "tb/")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every = cfg.train.log_every if cfg.diffusion.align.encoder is not None else 0

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every) and (step % self.every == 0 or last)

    def __call__(self, run) -> None:
        values = run.alignment.metrics()
        if values:
            run.log.log(run.step, images=run.images, **values)
