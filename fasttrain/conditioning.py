"""What a batch conditions the network on, and its dropout for classifier-free guidance (Ho & Salimans
2022, §3.2: the conditional and the unconditional model are one network, trained by replacing the
condition with a null condition at random).

The step (step.py) hands every micro-batch's condition to its `conditioning` part before the objective
sees it: `ClassLabels` replaces a class label by the null label `num_classes` with probability p,
`Unconditional` gives None (the data's labels are ignored). Each draws from its own generator (seeds.py:
"labels", per rank), so that how many random numbers the timestep sampler takes does not change which
labels are dropped, and the reverse. Another kind of condition (text: per-token states, a mask, a pooled
vector, micro-conditions) is another class with the same call.
"""
from __future__ import annotations

import torch


class Unconditional:
    """The network is not conditioned: whatever labels the data carry, the step passes None."""

    def __call__(self, y: torch.Tensor | None) -> None:
        return None


class ClassLabels:
    """Class labels with dropout to the null label `num_classes` (p = model.label_dropout)."""

    def __init__(self, num_classes: int, p: float, generator: torch.Generator):
        self.num_classes, self.p, self.generator = int(num_classes), float(p), generator

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        drop = torch.rand(y.shape, generator=self.generator, device=y.device) < self.p
        return torch.where(drop, torch.full_like(y, self.num_classes), y)


def for_data(spec, label_dropout: float, generator: torch.Generator) -> ClassLabels | Unconditional:
    """The conditioning of a run on data `spec` (bundle.DataSpec): what its data kind declares it
    conditions on (data/kinds.py, `Traits.conditioning`); class labels where the run has classes (0 when
    the model is not class-conditional), else none."""
    if spec.traits.conditioning == "class" and spec.num_classes:
        return ClassLabels(spec.num_classes, label_dropout, generator)
    return Unconditional()
