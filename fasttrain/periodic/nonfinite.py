"""The non-finite stop, every min(`train.max_nonfinite`, `train.log_every`) steps (one host read of the
skipped-step counters): a run of `max_nonfinite` skipped steps, or at least `max_nonfinite_frac` of the
last max(100, max_nonfinite) steps skipped (scattered bad batches never make a run), stops the run with
one line (NonFiniteStop; the trainer's error handler writes crash.pt on one process)."""
from __future__ import annotations

import torch

from ..config import unusual
from ..errors import NonFiniteStop
from . import Periodic, register


@register("nonfinite")
class NonFiniteCheck(Periodic):
    order = 30
    reads = ("state", "step", "checkpoints", "dist")
    saves = ()  # its marks are rebuilt from the skipped-step counter at the start of a (resumed) run

    def __init__(self, cfg):
        super().__init__(cfg)
        tc = cfg.train
        self.max_run, self.max_frac, self.log_every = tc.max_nonfinite, tc.max_nonfinite_frac, tc.log_every
        self.marks: list[tuple[int, int]] = []  # (step, skipped so far) at the checks

    def due(self, step: int, last: bool) -> bool:
        return bool(self.max_run) and step % min(self.max_run, self.log_every) == 0

    def start(self, run) -> None:
        self.marks = [(run.step, int(run.state.skipped))]  # where the non-finite rate is counted from

    def __call__(self, run) -> None:
        step = run.step
        total, in_a_row = torch.stack([run.state.skipped, run.state.skipped_run]).tolist()  # one host read
        marks = self.marks
        marks.append((step, total))
        window = max(100, self.max_run)
        while len(marks) > 1 and marks[1][0] <= step - window:
            marks.pop(0)
        step0, total0 = marks[0]
        frac = (total - total0) / max(step - step0, 1)
        if in_a_row >= self.max_run:
            why = f"{in_a_row} non-finite steps in a row"
        elif step - step0 >= window and frac >= self.max_frac:
            why = f"{total - total0} of the last {step - step0} steps were not finite"
        else:
            return
        kept = "the last good checkpoint is kept" if run.checkpoints.latest() else "no checkpoint had been written"
        crash = ", crash.pt holds this state" if run.dist.world_size == 1 else ""  # the trainer's handler writes it
        odd = unusual(self.cfg)  # an option far outside what practitioners use is the likeliest cause
        hint = (f"outside the usual range: {'; '.join(odd)}" if odd else
                "try a lower optim.lr, or check the data: `fasttrain data prepare`")
        raise NonFiniteStop(f"stopped at step {step}: {why} (skipped, weights kept); {kept}{crash} ({hint})")
