"""The trained network as the objective sees it: a backbone from `fasttrain.models` plus, optionally,
EDM2's learned per-timestep log-variance u(t) (Karras et al. 2024, §5 and `networks_edm2.Precond`) and
mixed prediction's learned per-timestep gate logits (mixed.py, gate=timestep).

Keeping u(t) and the gate table inside the network's parameters means they are sharded by FSDP,
reduced by DDP, averaged by the EMA and checkpointed like every other weight, with no optimizer
special cases; the forward returns them when asked (`return_logvar=True`, `return_gate=True`), as
EDM2's Precond does, so that wrapped models (FSDP gathers parameters in the root's forward) work
unchanged. Without `return_gate` a timestep gate's logits are appended to the output as H channels,
constant over the pixels, so that samplers see the pixel gate's layout (heads, then gate logits).
"""
from __future__ import annotations

import torch
from torch import nn

from .mixed import TimestepGate
from .schedule import NoiseSchedule
from .weighting import LearnedLogVar


class Denoiser(nn.Module):
    def __init__(self, net: nn.Module, schedule: NoiseSchedule | None = None, learned_weighting: bool = False,
                 gate_heads: int = 0):
        super().__init__()
        self.net = net
        self.logvar = LearnedLogVar(schedule) if learned_weighting else None
        self.gate = TimestepGate(schedule.T, gate_heads) if gate_heads else None

    def repeated_blocks(self) -> list[nn.Module]:
        """The backbone's repeated units (parallel.py checkpoints, compiles and shards them)."""
        return self.net.repeated_blocks()

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None, return_logvar: bool = False,
                return_gate: bool = False):
        """out; or (out, logvar), (out, gate [B, H]), (out, logvar, gate) for what is asked."""
        out = self.net(x, t, y)
        extra = []
        if return_logvar:
            if self.logvar is None:
                raise ValueError("this network has no learned weighting (diffusion.learned_weighting=false)")
            extra.append(self.logvar(t))
        if self.gate is not None:
            g = self.gate(t)
            if return_gate:
                extra.append(g)
            else:
                g = g.to(out.dtype).reshape(*g.shape, *([1] * (out.ndim - 2)))
                out = torch.cat([out, g.expand(-1, -1, *out.shape[2:])], dim=1)
        elif return_gate:
            raise ValueError("this network has no timestep gate (mixed.gate=timestep)")
        return (out, *extra) if extra else out
