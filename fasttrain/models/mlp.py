"""An MLP denoiser for 2-D toy distributions."""
from __future__ import annotations

import torch
from torch import nn

from . import register
from .layers import TimeLabelEmbedding


@register("mlp")
class MLPDenoiser(nn.Module):
    def __init__(self, in_channels: int = 2, hidden: int = 256, depth: int = 4, num_classes: int = 0,
                 out_channels: int | None = None):
        super().__init__()
        self.in_channels = in_channels
        self.embed = TimeLabelEmbedding(64, hidden, num_classes)
        self.inp = nn.Linear(in_channels, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden)) for _ in range(depth))
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, out_channels or in_channels))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embed(t, y)
        h = self.inp(x) + emb
        for blk in self.blocks:
            h = h + blk(h + emb)  # residual MLP, time injected at every block
        return self.out(h)

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)
