"""The trained network as the objective sees it: a backbone from `fasttrain.models` plus, optionally,
EDM2's learned per-timestep log-variance u(t) (Karras et al. 2024, §5 and `networks_edm2.Precond`).

Keeping u(t) inside the network's parameters means it is sharded by FSDP, reduced by DDP, averaged
by the EMA and checkpointed like every other weight, with no optimizer special cases; the forward
returns it when asked (`return_logvar=True`), as EDM2's Precond does, so that wrapped models (FSDP
gathers parameters in the root's forward) work unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from .schedule import NoiseSchedule
from .weighting import LearnedLogVar


class Denoiser(nn.Module):
    def __init__(self, net: nn.Module, schedule: NoiseSchedule | None = None, learned_weighting: bool = False):
        super().__init__()
        self.net = net
        self.logvar = LearnedLogVar(schedule) if learned_weighting else None

    def repeated_blocks(self) -> list[nn.Module]:
        """The backbone's repeated units (parallel.py checkpoints, compiles and shards them)."""
        return self.net.repeated_blocks()

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None, return_logvar: bool = False):
        out = self.net(x, t, y)
        if not return_logvar:
            return out
        if self.logvar is None:
            raise ValueError("this network has no learned weighting (diffusion.learned_weighting=false)")
        return out, self.logvar(t)
