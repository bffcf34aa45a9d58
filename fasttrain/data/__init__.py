"""Data: one factory for the trainer. Batches are (x0 [B, ...] float32, labels Long[B]) on the device.

Every `data.name` is a registered data kind with declared traits (kinds.py): the built-in ones (digits,
toys, synthetic: builtin.py) live on the training device (memory.py), so a resumed run sees exactly
the batches it would have seen; image folders (`folder`, image_folder.py) and .npy latent folders
(`latents`, latent_folder.py) go through NVIDIA DALI (`data.backend=dali`, dali.py) or a torch
DataLoader (`torch`, loader.py); `auto` takes DALI where it is installed. Both read the file list of
the folder's manifest (manifest.py), so corrupt files are skipped, not fatal. Every stream reads the
same order (order.py). Latents encoded by a VAE (`data prepare --vae`, encode.py) are drawn from their
posterior and normalised on the device (latents.py); their record (`DataInfo.latents`) goes into the
checkpoint. A new data kind is one module here that registers itself (kinds.py).
"""
from __future__ import annotations

from ..errors import InvalidInput
from ..registry import discover as _discover
from . import dali
from .builtin import TOYS, digits, synthetic, toy
from .kinds import DATA_KINDS, DataArgs, DataInfo, DataKind, Reference, Traits, data_kind, names, traits

_discover(__name__)  # the data kinds in their own modules (image_folder.py, ...) register themselves

BACKENDS = ("auto", "torch", "dali")


def resolve_backend(backend: str, name: str) -> str:
    """What reads data set `name` for `data.backend`: "memory" for a resident kind, else "dali" or "torch"."""
    if backend not in BACKENDS:
        raise InvalidInput(f"unknown data backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if traits(name).resident:
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
               rank: int = 0, world_size: int = 1, latent_norm: str = "auto", shuffle_buffer: int = 1000,
               buckets: bool = False, min_bucket_reso: int = 256, max_bucket_reso: int = 1024,
               bucket_reso_steps: int = 64):
    """Return (stream, DataInfo) for the data kind `name` (a built-in set, an image or a latent folder)."""
    if name not in names():
        raise InvalidInput(f"unknown data set {name!r}; choose from {', '.join(names())}")
    reader = resolve_backend(backend, name)
    args = DataArgs(batch_size, seed, image_size, root, channels, holdout, device, num_workers, split, manifest, crop,
                    flip, rank, world_size, latent_norm, shuffle_buffer, buckets, min_bucket_reso, max_bucket_reso,
                    bucket_reso_steps)
    return data_kind(name).build(args, reader)


__all__ = ["BACKENDS", "DATA_KINDS", "DataArgs", "DataInfo", "DataKind", "Reference", "TOYS", "Traits",
           "build_data", "data_kind", "digits", "names", "resolve_backend", "synthetic", "toy", "traits"]
