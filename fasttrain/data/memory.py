"""Built-in data resident on the training device: batches are gathered by a seeded permutation per
epoch (order.py) that is copied there once per epoch, so a batch costs no host→device copy and no
sync, and the position in the stream is (epoch, index)."""
from __future__ import annotations

import torch

from ..errors import DataError
from .order import Position, epoch_order


class MemoryStream(Position):
    """Infinite batches of in-memory data resident on the device; `state_dict()` = (epoch, pos)."""

    def __init__(self, x, y, batch_size: int, seed: int, device="cpu", rank: int = 0, world_size: int = 1):
        n = len(x)
        if batch_size > n // world_size:
            raise DataError(f"data.batch_size {batch_size} is larger than the data set ({n}) per rank")
        self.device = torch.device(device)
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.n, self.batch_size, self.seed, self.rank, self.world_size = n, batch_size, seed, rank, world_size
        self.epoch, self.pos = 0, 0
        self._cache: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            idx = epoch_order(self.n, self.seed, epoch, self.rank, self.world_size)
            if self.device.type == "cuda":
                idx = idx.pin_memory()
            self._cache = {e: v for e, v in self._cache.items() if e >= epoch - 1}
            self._cache[epoch] = idx.to(self.device, non_blocking=True)
        return self._cache[epoch]

    def __iter__(self):
        return self

    def __next__(self):
        idx = self.next_indices()
        return self.x[idx], self.y[idx]

    def next_indices(self) -> torch.Tensor:
        """The rows of `x` and `y` the next batch takes (the stream advances): what reads per-image tables
        beside the data uses it (the alignment's cached targets, diffusion/align.py)."""
        order, per_rank = self._order(self.epoch), self.n // self.world_size
        end = self.pos + self.batch_size
        if end <= per_rank:
            idx = order[self.pos:end]
            self.pos = end
        else:  # the batch straddles two epochs
            idx = torch.cat([order[self.pos:], self._order(self.epoch + 1)[: end - per_rank]])
            self.epoch, self.pos = self.epoch + 1, end - per_rank
        if self.pos == per_rank:
            self.epoch, self.pos = self.epoch + 1, 0
        return idx
