"""Data: one factory for the trainer. Batches are (x0 [B, ...] float32, labels Long[B]).

Built-in data (digits, toys) stays in memory and is indexed by a seeded per-epoch permutation, so the
position in the stream is (epoch, index) and a resumed run sees exactly the batches it would have seen.
Image folders (`folder`) and .npy latent folders (`latents`) go through NVIDIA DALI (`data.backend=
dali`, dali.py) or a torch DataLoader (`torch`); `auto` takes DALI where it is installed. Both read
the file list of the folder's manifest (manifest.py), so corrupt files are skipped, not fatal.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler

from . import dali
from .builtin import TOYS, digits, toy
from .folder import ImageFolderDataset, LatentFolderDataset
from .manifest import build_manifest, load_manifest

DATASETS = ("digits", "folder", "latents") + TOYS
BACKENDS = ("auto", "torch", "dali")


@dataclass
class DataInfo:
    channels: int
    image_size: int | None  # None for 2-D toy data
    num_classes: int
    size: int


class _EpochPermutation(Sampler):
    """This rank's indices of a seeded permutation per epoch (dali.shard), from a saved position."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.rank, self.world_size, self.epoch, self.pos = n, seed, rank, world_size, 0, 0

    def __iter__(self):
        while True:
            idx = dali.shard(self.n, self.seed, self.epoch, self.rank, self.world_size)
            while self.pos < len(idx):
                self.pos += 1
                yield int(idx[self.pos - 1])
            self.epoch, self.pos = self.epoch + 1, 0

    def __len__(self):
        return 2**62


class BatchStream:
    """Infinite stream of batches with `state_dict()` = its position (epoch, index)."""

    def __init__(self, x, y, batch_size: int, seed: int, device="cpu", dataset=None, num_workers: int = 0,
                 rank: int = 0, world_size: int = 1):
        self.x, self.y, self.batch_size, self.device = x, y, batch_size, torch.device(device)
        n = len(x) if dataset is None else len(dataset)
        if batch_size > n // world_size:
            raise ValueError(f"data.batch_size {batch_size} is larger than the data set ({n}) per rank")
        self.order = _EpochPermutation(n, seed, rank, world_size)
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


def _folder_manifest(root: str, manifest_path: str | None) -> dict:
    m = load_manifest(root, manifest_path)
    if m is None:
        print(f"fasttrain: checking {root} (run `fasttrain data prepare {root}` once to cache this)", file=sys.stderr)
        m = build_manifest(root)
    if m["bad"]:
        shown = ", ".join(b[0] for b in m["bad"][:3])
        print(f"fasttrain: skipping {len(m['bad'])} unreadable file(s): {shown}{' ...' if len(m['bad']) > 3 else ''}",
              file=sys.stderr)
    if not m["files"]:
        raise ValueError(f"data.root {root!r} holds no readable files")
    return m


def resolve_backend(backend: str, name: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown data backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if name not in ("folder", "latents"):
        if backend == "dali":
            raise ValueError(f"data.backend=dali reads image or latent folders; {name!r} is built in (use auto or torch)")
        return "memory"
    if backend == "auto":
        return "dali" if dali.available() else "torch"
    if backend == "dali" and not dali.available():
        raise ValueError("data.backend=dali but NVIDIA DALI is not installed (pip install 'fasttrain[dali]')")
    return backend


def build_data(name: str, *, batch_size: int, seed: int = 0, image_size: int = 8, root: str | None = None,
               channels: int = 3, holdout: int = 400, device="cpu", num_workers: int = 0, split: str = "train",
               backend: str = "auto", manifest: str | None = None, crop: str = "center", flip: bool = True,
               rank: int = 0, world_size: int = 1):
    """Return (stream, DataInfo) for a built-in data set, an image folder or a latent folder."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    kind = resolve_backend(backend, name)
    if name == "digits":
        x, y = digits(image_size, split=split, holdout=holdout, seed=0)
        return BatchStream(x, y, batch_size, seed, device, rank=rank, world_size=world_size), DataInfo(1, image_size, 10, len(x))
    if name in TOYS:
        x = toy(name, seed=0 if split == "train" else 1)
        y = torch.zeros(len(x), dtype=torch.long)
        return BatchStream(x, y, batch_size, seed, device, rank=rank, world_size=world_size), DataInfo(2, None, 0, len(x))
    if not root:
        raise ValueError(f"data.root must name a folder when data.name={name}")
    m = _folder_manifest(root, manifest)
    files = [tuple(f) for f in m["files"]]
    if name == "latents":
        ds = LatentFolderDataset(root, m)
        shape = ds.shape()
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(f"latents must be stored as [C, S, S] arrays, {ds.files[0][0]} has shape {shape}")
        info = DataInfo(shape[0], shape[1], len(m["classes"]), len(files))
    else:
        ds = ImageFolderDataset(root, image_size, channels, flip=flip, crop=crop, manifest=m)
        info = DataInfo(channels, image_size, len(m["classes"]), len(files))
    if kind == "dali":
        stream = dali.DaliStream("latents" if name == "latents" else "images", root, files, batch_size,
                                 image_size=image_size, channels=channels, seed=seed, rank=rank, world_size=world_size,
                                 device=device, num_threads=max(1, num_workers), crop=crop, flip=flip)
        return stream, info
    return BatchStream(None, None, batch_size, seed, device, dataset=ds, num_workers=num_workers, rank=rank,
                       world_size=world_size), info
