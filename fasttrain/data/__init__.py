"""Data: one factory for the trainer. Batches are (x0 [B, ...] float32, labels Long[B]).

Built-in data (digits, toys) stays in memory and is indexed by a seeded per-epoch permutation, so the
position in the stream is (epoch, index) and a resumed run sees exactly the batches it would have seen.
Image folders go through a torch DataLoader with the same resumable permutation as its sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler

from .builtin import TOYS, digits, toy
from .folder import ImageFolderDataset

DATASETS = ("digits", "folder") + TOYS


@dataclass
class DataInfo:
    channels: int
    image_size: int | None  # None for 2-D toy data
    num_classes: int
    size: int


class _EpochPermutation(Sampler):
    """Indices of a seeded permutation per epoch, starting at a saved position."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def _perm(self):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + self.epoch))

    def __iter__(self):
        while True:
            perm = self._perm()
            while self.pos < self.n:
                self.pos += 1
                yield int(perm[self.pos - 1])
            self.epoch, self.pos = self.epoch + 1, 0

    def __len__(self):
        return 2**62


class BatchStream:
    """Infinite stream of batches with `state_dict()` = its position (epoch, index)."""

    def __init__(self, x, y, batch_size: int, seed: int, device="cpu", dataset=None, num_workers: int = 0):
        self.x, self.y, self.batch_size, self.device = x, y, batch_size, torch.device(device)
        n = len(x) if dataset is None else len(dataset)
        if batch_size > n:
            raise ValueError(f"data.batch_size {batch_size} is larger than the data set ({n})")
        self.order = _EpochPermutation(n, seed)
        self.dataset, self.num_workers = dataset, num_workers
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.dataset is None:
            it = iter(self.order) if self._it is None else self._it
            self._it = it
            idx = torch.tensor([next(it) for _ in range(self.batch_size)])
            return self.x[idx].to(self.device), self.y[idx].to(self.device)
        if self._it is None:
            # Workers would read ahead of the saved position; with workers, resume is per batch only.
            loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.order,
                                num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
            self._it = iter(loader)
        x, y = next(self._it)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        return {"epoch": self.order.epoch, "pos": self.order.pos}

    def load_state_dict(self, state):
        self.order.epoch, self.order.pos = int(state["epoch"]), int(state["pos"])
        self._it = None


def build_data(name: str, *, batch_size: int, seed: int = 0, image_size: int = 8, root: str | None = None,
               channels: int = 3, holdout: int = 400, device="cpu", num_workers: int = 0, split: str = "train"):
    """Return (BatchStream, DataInfo) for a built-in data set or an image folder."""
    if name == "digits":
        x, y = digits(image_size, split=split, holdout=holdout, seed=0)
        return BatchStream(x, y, batch_size, seed, device), DataInfo(1, image_size, 10, len(x))
    if name in TOYS:
        x = toy(name, seed=0 if split == "train" else 1)
        y = torch.zeros(len(x), dtype=torch.long)
        return BatchStream(x, y, batch_size, seed, device), DataInfo(2, None, 0, len(x))
    if name == "folder":
        if not root:
            raise ValueError("data.root must name an image folder when data.name=folder")
        ds = ImageFolderDataset(root, image_size, channels)
        info = DataInfo(channels, image_size, ds.num_classes, len(ds))
        return BatchStream(None, None, batch_size, seed, device, dataset=ds, num_workers=num_workers), info
    raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
