"""Look-ahead around the optimizer step: the one generic hook through which components learn how an
update changes the model's losses (the adaptive timestep sampler; the cross-timestep interference
diagnostic).

The trainer knows nothing about either: every `train.step`, for each component that is a
`LookAhead` and whose `due(step)` is true, it calls `before_update(ctx)` after the gradients of the
step are complete (all micro-batches accumulated) and before `optimizer.step()`, and
`after_update(ctx)` right after it. `ctx` (`LookAheadContext`) carries the model and the step's
first micro-batch; components evaluate the model on their own probes through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LookAheadContext:
    model: Any                      # the training model (possibly FSDP/DDP-wrapped): call it, do not unwrap it
    objective: Any                  # the DiffusionObjective: schedule, tables, seed, x0_hat(output, x_t, t)
    x0: torch.Tensor                # the step's first micro-batch
    labels: torch.Tensor | None     # its labels (after label dropout), or None
    step: int                       # the optimizer step about to be taken (0-based)
    rank: int = 0
    world_size: int = 1


class LookAhead:
    """Mixin for components with a look-ahead. `every` is the period in optimizer steps."""

    every: int = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def before_update(self, ctx: LookAheadContext) -> None:
        pass

    def after_update(self, ctx: LookAheadContext) -> None:
        pass


def lookaheads(*components) -> list[LookAhead]:
    return [c for c in components if isinstance(c, LookAhead)]
