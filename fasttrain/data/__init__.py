"""Data: one factory for the trainer. Batches are (x0 [B, ...] float32, labels Long[B]) on the device.

Built-in data (digits, toys, builtin.py) live on the training device (memory.py); a resumed run sees
exactly the batches it would have seen. Image folders (`folder`) and .npy latent folders (`latents`,
folder.py) go through NVIDIA DALI (`data.backend=dali`, dali.py) or a torch DataLoader (`torch`,
loader.py); `auto` takes DALI where it is installed. Both read the file list of the folder's manifest
(manifest.py), so corrupt files are skipped, not fatal. Every stream reads the same order (order.py).
Latents encoded by a VAE (`data prepare --vae`, encode.py) are drawn from their posterior and
normalised on the device (latents.py); their record (`DataInfo.latents`) goes into the checkpoint.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import DataError, InvalidInput
from . import dali
from .builtin import TOYS, digits, synthetic, toy
from .folder import ImageFolderDataset, LatentFolderDataset
from .latents import LatentStream
from .loader import LoaderStream
from .manifest import build_manifest, load_manifest
from .memory import MemoryStream

DATASETS = ("digits", "folder", "latents", "synthetic") + TOYS
BACKENDS = ("auto", "torch", "dali")


@dataclass
class DataInfo:
    channels: int
    image_size: int | None  # None for 2-D toy data
    num_classes: int
    size: int
    latents: dict | None = None  # a latent folder's VAE, normalisation and statistics (vae.latent_record)
    class_names: list | None = None  # the classes' names (folders: the class subfolders), by label


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
        raise DataError(f"data.root {root!r} holds no readable files")
    return m


def resolve_backend(backend: str, name: str) -> str:
    if backend not in BACKENDS:
        raise InvalidInput(f"unknown data backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if name not in ("folder", "latents"):
        if backend == "dali":
            raise InvalidInput(f"data.backend=dali reads image or latent folders; {name!r} is built "
                               "in (use auto or torch)")
        return "memory"
    if backend == "auto":
        return "dali" if dali.available() else "torch"
    if backend == "dali" and not dali.available():
        raise InvalidInput("data.backend=dali but NVIDIA DALI is not installed (pip install 'fasttrain[dali]')")
    return backend


def build_data(name: str, *, batch_size: int, seed: int = 0, image_size: int = 8, root: str | None = None,
               channels: int = 3, holdout: int = 400, device="cpu", num_workers: int = 0, split: str = "train",
               backend: str = "auto", manifest: str | None = None, crop: str = "center", flip: bool = True,
               rank: int = 0, world_size: int = 1, latent_norm: str = "auto"):
    """Return (stream, DataInfo) for a built-in data set, an image folder or a latent folder."""
    if name not in DATASETS:
        raise InvalidInput(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    kind = resolve_backend(backend, name)
    if name == "digits":
        x, y = digits(image_size, split=split, holdout=holdout, seed=0)
        return (MemoryStream(x, y, batch_size, seed, device, rank, world_size),
                DataInfo(1, image_size, 10, len(x), class_names=[str(i) for i in range(10)]))
    if name == "synthetic":
        x, y = synthetic(channels, image_size, seed=0 if split == "train" else 1)
        return (MemoryStream(x, y, batch_size, seed, device, rank, world_size),
                DataInfo(channels, image_size, 10, len(x)))
    if name in TOYS:
        x = toy(name, seed=0 if split == "train" else 1)
        y = torch.zeros(len(x), dtype=torch.long)
        return MemoryStream(x, y, batch_size, seed, device, rank, world_size), DataInfo(2, None, 0, len(x))
    if not root:
        raise InvalidInput(f"data.root must name a folder when data.name={name}")
    if channels not in (1, 3):
        raise InvalidInput(f"data.channels must be 1 (grey) or 3 (RGB) for image folders, got {channels}")
    m = _folder_manifest(root, manifest)
    files = [tuple(f) for f in m["files"]]
    record = None
    if name == "latents":
        from ..vae import latent_record

        ds = LatentFolderDataset(root, m)
        shape = ds.shape()
        if len(shape) != 3 or shape[1] != shape[2]:
            raise DataError(f"latents must be stored as [C, S, S] arrays, {ds.files[0][0]} has shape {shape}")
        record = latent_record(m.get("latents"), latent_norm)
        c = record["channels"] if record else shape[0]
        if record and shape[0] != c * (2 if record["posterior"] else 1):
            raise DataError(f"{ds.files[0][0]} has {shape[0]} channels, the manifest records {c} latent channels"
                            f"{' (mean and std)' if record['posterior'] else ''}: run `fasttrain data prepare` again")
        info = DataInfo(c, shape[1], len(m["classes"]), len(files), record, list(m["classes"]))
    else:
        ds = ImageFolderDataset(root, image_size, channels, manifest=m)
        info = DataInfo(channels, image_size, len(m["classes"]), len(files), class_names=list(m["classes"]))
    if kind == "dali":
        stream = dali.DaliStream("latents" if name == "latents" else "images", root, files, batch_size,
                                 image_size=image_size, channels=channels, seed=seed, rank=rank, world_size=world_size,
                                 device=device, num_threads=max(1, num_workers), crop=crop, flip=flip)
    else:
        augment = None if name == "latents" else (flip, crop == "random")
        stream = LoaderStream(ds, batch_size, seed, device, num_workers, rank, world_size, augment)
    return (LatentStream(stream, record, seed, rank) if record else stream), info
