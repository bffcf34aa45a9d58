"""Data: one factory for the trainer. Batches are (x0 [B, ...] float32, labels Long[B]) on the device.

Built-in data (digits, toys) live on the training device, indexed by a seeded permutation per epoch
that is copied there once per epoch, so a batch costs no host→device copy and no sync, and the
position in the stream is (epoch, index): a resumed run sees exactly the batches it would have seen.
Image folders (`folder`) and .npy latent folders (`latents`) go through NVIDIA DALI (`data.backend=
dali`, dali.py) or a torch DataLoader (`torch`; pinned memory, non-blocking copies, the next batch
in flight while the current one trains); `auto` takes DALI where it is installed. Both read the file
list of the folder's manifest (manifest.py), so corrupt files are skipped, not fatal.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler

from . import dali
from .builtin import TOYS, digits, synthetic, toy
from .order import augment_table, epoch_order
from .folder import ImageFolderDataset, LatentFolderDataset
from .manifest import build_manifest, load_manifest

DATASETS = ("digits", "folder", "latents", "synthetic") + TOYS
BACKENDS = ("auto", "torch", "dali")


@dataclass
class DataInfo:
    channels: int
    image_size: int | None  # None for 2-D toy data
    num_classes: int
    size: int


class MemoryStream:
    """Infinite batches of in-memory data resident on the device; `state_dict()` = (epoch, pos)."""

    def __init__(self, x, y, batch_size: int, seed: int, device="cpu", rank: int = 0, world_size: int = 1):
        n = len(x)
        if batch_size > n // world_size:
            raise ValueError(f"data.batch_size {batch_size} is larger than the data set ({n}) per rank")
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
        return self.x[idx], self.y[idx]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class _Order(Sampler):
    """This rank's indices from a saved position onwards, epoch after epoch; with `augment` = (flip,
    random crop), each index comes with its sample's augmentation draws (order.augment_table)."""

    def __init__(self, n: int, seed: int, rank: int, world_size: int, epoch: int, pos: int,
                 augment: tuple[bool, bool] | None = None):
        self.n, self.seed, self.rank, self.world_size, self.epoch, self.pos = n, seed, rank, world_size, epoch, pos
        self.augment = augment

    def __iter__(self):
        epoch, pos = self.epoch, self.pos
        while True:
            order = epoch_order(self.n, self.seed, epoch, self.rank, self.world_size)
            if self.augment is None:
                yield from order[pos:].tolist()
            else:
                aug = augment_table(len(order), self.seed, epoch, self.rank, *self.augment)
                yield from ((i, *a) for i, a in zip(order[pos:].tolist(), aug[pos:].tolist()))
            epoch, pos = epoch + 1, 0

    def __len__(self):
        return 2**62


class LoaderStream:
    """Batches of a folder data set through a DataLoader: pinned memory, a non-blocking copy to the
    device, and the next batch already on its way while the current one trains. `state_dict()` is the
    position of the batches handed out (not of those prefetched), so resume is exact."""

    def __init__(self, dataset, batch_size: int, seed: int, device="cpu", num_workers: int = 0,
                 rank: int = 0, world_size: int = 1, augment: tuple[bool, bool] | None = None):
        n = len(dataset)
        if batch_size > n // world_size:
            raise ValueError(f"data.batch_size {batch_size} is larger than the data set ({n}) per rank")
        self.dataset, self.batch_size, self.seed, self.device = dataset, batch_size, seed, torch.device(device)
        self.num_workers, self.rank, self.world_size, self.per_rank = num_workers, rank, world_size, n // world_size
        self.epoch, self.pos, self.augment = 0, 0, augment
        self._it, self._next, self._stream = None, None, None

    def _start(self):
        order = _Order(len(self.dataset), self.seed, self.rank, self.world_size, self.epoch, self.pos, self.augment)
        self._it = iter(DataLoader(self.dataset, batch_size=self.batch_size, sampler=order,
                                   num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                                   pin_memory=self.device.type == "cuda"))
        self._next = self._fetch()

    def _fetch(self):
        """The next batch, its copy to the device issued now: on CUDA on a side stream (an event marks
        its end), so it overlaps the step that is running."""
        x, y = next(self._it)
        if self.device.type != "cuda":
            return x, y, None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return x, y, done

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._start()
        (x, y, done), self._next = self._next, self._fetch()
        if done is not None:  # the consumer waits for this batch's copy only, and owns its memory
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            x.record_stream(current)
            y.record_stream(current)
        self.pos += self.batch_size
        while self.pos >= self.per_rank:
            self.epoch, self.pos = self.epoch + 1, self.pos - self.per_rank
        return x, y

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._it, self._next = None, None


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
        return (MemoryStream(x, y, batch_size, seed, device, rank, world_size),
                DataInfo(1, image_size, 10, len(x)))
    if name == "synthetic":
        x, y = synthetic(channels, image_size, seed=0 if split == "train" else 1)
        return (MemoryStream(x, y, batch_size, seed, device, rank, world_size),
                DataInfo(channels, image_size, 10, len(x)))
    if name in TOYS:
        x = toy(name, seed=0 if split == "train" else 1)
        y = torch.zeros(len(x), dtype=torch.long)
        return MemoryStream(x, y, batch_size, seed, device, rank, world_size), DataInfo(2, None, 0, len(x))
    if not root:
        raise ValueError(f"data.root must name a folder when data.name={name}")
    if channels not in (1, 3):
        raise ValueError(f"data.channels must be 1 (grey) or 3 (RGB) for image folders, got {channels}")
    m = _folder_manifest(root, manifest)
    files = [tuple(f) for f in m["files"]]
    if name == "latents":
        ds = LatentFolderDataset(root, m)
        shape = ds.shape()
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(f"latents must be stored as [C, S, S] arrays, {ds.files[0][0]} has shape {shape}")
        info = DataInfo(shape[0], shape[1], len(m["classes"]), len(files))
    else:
        ds = ImageFolderDataset(root, image_size, channels, manifest=m)
        info = DataInfo(channels, image_size, len(m["classes"]), len(files))
    if kind == "dali":
        stream = dali.DaliStream("latents" if name == "latents" else "images", root, files, batch_size,
                                 image_size=image_size, channels=channels, seed=seed, rank=rank, world_size=world_size,
                                 device=device, num_threads=max(1, num_workers), crop=crop, flip=flip)
        return stream, info
    augment = None if name == "latents" else (flip, crop == "random")
    return LoaderStream(ds, batch_size, seed, device, num_workers, rank, world_size, augment), info
