"""Layers shared by the model families: timestep and class embeddings."""
from __future__ import annotations

import math

import torch
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (integer or real) timesteps (Vaswani et al. 2017; ADM `timestep_embedding`)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1) if dim % 2 else emb


class TimeLabelEmbedding(nn.Module):
    """t → sinusoid → MLP, plus an optional class embedding with one extra "null" row used by
    classifier-free guidance (label `num_classes` means unconditional)."""

    def __init__(self, freq_dim: int, dim: int, num_classes: int = 0):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.num_classes = num_classes
        self.label = nn.Embedding(num_classes + 1, dim) if num_classes > 0 else None

    def forward(self, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))  # bf16 under FSDP mp
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
