"""The order of the data: one seeded permutation per epoch, sharded across ranks. Every backend (the
in-memory stream, the DataLoader, DALI) reads this order, so they give the same batches and a
resumed run continues exactly."""
from __future__ import annotations

import torch

from .. import seeds


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's indices of epoch `epoch`: a permutation seeded by (seed, epoch), every world_size-th
    element, truncated so that every rank gets n // world_size."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seeds.derive(seed, "data", epoch)))
    return perm[rank::world_size][: n // world_size]
