"""The order of the data: one seeded permutation per epoch, sharded across ranks, and each sample's
augmentation draws. Every backend (the in-memory stream, the DataLoader, DALI) reads this order and
these draws, so they give the same batches, augmentations included, and a resumed run continues
exactly."""
from __future__ import annotations

import torch

from .. import seeds


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's indices of epoch `epoch`: a permutation seeded by (seed, epoch), every world_size-th
    element, truncated so that every rank gets n // world_size."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seeds.derive(seed, "data", epoch)))
    return perm[rank::world_size][: n // world_size]


def augment_table(per_rank: int, seed: int, epoch: int, rank: int, flip: bool, random_crop: bool) -> torch.Tensor:
    """[per_rank, 3] float64 (mirror 0/1, crop_x, crop_y in [0, 1]) for each sample of this rank's epoch,
    in epoch_order's order; a centre crop is (0.5, 0.5)."""
    g = torch.Generator().manual_seed(seeds.derive(seed, "augment", epoch, rank))
    aug = torch.rand(per_rank, 3, generator=g, dtype=torch.float64)
    aug[:, 0] = (aug[:, 0] < 0.5).double() if flip else 0.0
    if not random_crop:
        aug[:, 1:] = 0.5
    return aug


class Position:
    """A stream's place in the data: (epoch, pos) on this rank's shard, saved with the world size it was
    counted in; a resume on another world size keeps the fraction of the epoch (shards are n // world)."""

    epoch: int
    pos: int
    world_size: int

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        pos, old = int(state["pos"]), int(state.get("world_size", self.world_size))
        self.epoch, self.pos = int(state["epoch"]), pos * old // self.world_size
        self._restart()

    def _restart(self) -> None:
        """Drop what was read ahead of the restored position."""
