"""STAND-IN for fasttrain/diffusion/immiscible.py (branch strat21), to be replaced at merge: the same
three signatures, minimal implementations, so that the noise options' immiscible row map
(noise_options.py) runs and is tested before that module lands.

  assignment(dist [B, B]) -> Long[B]        image i takes noise rows[i]; approximate (greedy: the globally
                                            smallest remaining distance first), on the device, no host sync
  exact_assignment(dist [B, B]) -> Long[B]  scipy's linear_sum_assignment (tests, benchmarks; host)
  knn_choice(dist [B, k]) -> Long[B]        the nearest of each image's k candidates
"""
from __future__ import annotations

import torch


def assignment(dist: torch.Tensor) -> torch.Tensor:
    B = dist.shape[0]
    d = dist.detach().float().clone()
    rows = torch.empty(B, dtype=torch.long, device=d.device)
    for _ in range(B):  # B small device ops, no host read
        k = torch.argmin(d).view(1)
        i, j = k // B, k % B
        rows.index_copy_(0, i, j)
        d.index_fill_(0, i, float("inf"))
        d.index_fill_(1, j, float("inf"))
    return rows


def exact_assignment(dist: torch.Tensor) -> torch.Tensor:
    from scipy.optimize import linear_sum_assignment

    _, col = linear_sum_assignment(dist.detach().double().cpu().numpy())
    return torch.as_tensor(col, dtype=torch.long, device=dist.device)


def knn_choice(dist: torch.Tensor) -> torch.Tensor:
    return dist.argmin(1)
