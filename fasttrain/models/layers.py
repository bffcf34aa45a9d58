"""Layers shared by the model families: timestep and class embeddings."""
from __future__ import annotations

import math

import torch
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0, freq_shift: int = 0) -> torch.Tensor:
    """Sinusoidal embedding [cos, sin] of (integer or real) timesteps (Vaswani et al. 2017; ADM
    `timestep_embedding`) with frequencies exp(−ln(max_period)·k/(half − freq_shift)), k < half: ADM and
    the original DiT use shift 0, diffusers' DiTTransformer2DModel hard-codes 1 (`Timesteps(256,
    flip_sin_to_cos=True, downscale_freq_shift=1)`), UNet2DModel takes it from its config (`freq_shift`)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32)
                      / (half - freq_shift))
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1) if dim % 2 else emb


class TimeLabelEmbedding(nn.Module):
    """t → sinusoid → MLP, plus an optional class embedding with one extra "null" row used by
    classifier-free guidance (label `num_classes` means unconditional, as the last row of diffusers'
    `LabelEmbedding`)."""

    def __init__(self, freq_dim: int, dim: int, num_classes: int = 0, freq_shift: int = 0):
        super().__init__()
        self.freq_dim, self.freq_shift = freq_dim, freq_shift
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.num_classes = num_classes
        self.label = nn.Embedding(num_classes + 1, dim) if num_classes > 0 else None

    def forward(self, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        freqs = timestep_embedding(t, self.freq_dim, freq_shift=self.freq_shift)
        emb = self.mlp(freqs.to(self.mlp[0].weight.dtype))  # bf16 under FSDP mp
        if self.label is not None:
            if y is None:
                y = torch.full_like(t, self.num_classes)
            emb = emb + self.label(y)
        return emb


def zero_module(m: nn.Module) -> nn.Module:
    """Zero-initialise the last layer of a residual branch so every block starts as the identity."""
    for p in m.parameters():
        nn.init.zeros_(p)
    return m
