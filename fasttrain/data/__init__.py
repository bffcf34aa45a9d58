"""Data: every `data.name` is a registered data kind with declared traits (`kinds.py`), built from the
`data` config section whole (`build_data(cfg.data, seed=..., rank=...)`: the kind reads its own fields).
Batches are (x0 [B, ...] float32, labels Long[B]) on the device.

The kinds, one module per kind or family:
  `builtin.py`         digits, the 2-D toys, synthetic: resident on the training device (`memory.py`)
  `image_folder.py`    `folder`: images (class subfolders give labels), optional aspect-ratio buckets (`buckets.py`)
  `latent_folder.py`   `latents`: .npy latents (`data prepare --vae`, `encode.py`), and `decoded` (outputs only)
  `packed.py`          `packed`: a latent folder packed into one memory-mapped array (`data prepare --pack`)
  `bucket_latents.py`  `bucket_latents`: VAE latents cached per aspect-ratio bucket
  `shards.py`          `shards`: WebDataset tar shards of images, one global seeded order split by rank
  `latent_shards.py`   `captioned_shards`: tar shards of VAE latents with their captions' encodings
  `captioned.py`       `captioned_latents`, `captioned_digits`: latents with cached caption encodings
  `prior.py`           `data.prior`: captioned latents paired with DreamBooth class latents (prior preservation)
What they share: `streamed.py` (a folder's manifest and its stream), `dali.py` (NVIDIA DALI) and
`loader.py` (a torch DataLoader), `order.py` (the epoch order and augmentation draws every backend reads),
`folder.py` (folder data sets), `images.py` (decoding one image), `layout.py` (a folder's files and labels),
`manifest.py` (`data prepare`: the checked file list), `captions.py` (a folder's captions), `masks.py` (loss
masks per image: alpha or NAME.mask.png, data.mask), `latents.py` (posterior draws and normalisation on the
device), `shard_index.py` (a shard set's index, its checks and its global order), `shard_reader.py` (each
rank's samples read by seeking), `reference.py` (the real data evaluations compare with), `spec.py`
(`DataSpec`: what a run's data are, recorded in its checkpoint).
A new data kind is one module here that registers itself (kinds.py).
"""
from __future__ import annotations

from ..errors import InvalidInput
from ..registry import discover as _discover
from . import dali
from .builtin import TOYS, digits, synthetic, toy
from .kinds import DATA_KINDS, DataInfo, DataKind, Placement, Reference, Traits, data_kind, names, traits

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


def build_data(d, **placement):
    """(stream, DataInfo) of the `data` section `d` (cfg.data, or a config.DataConfig): its kind's `build`
    reads its own fields; `placement`: where and for whom (kinds.Placement: seed, device, rank, world_size,
    split)."""
    if d.name not in names():
        raise InvalidInput(f"unknown data set {d.name!r}; choose from {', '.join(names())}")
    return data_kind(d.name).build(d, Placement(**placement), resolve_backend(d.backend, d.name))


__all__ = ["BACKENDS", "DATA_KINDS", "DataInfo", "DataKind", "Placement", "Reference", "TOYS", "Traits",
           "build_data", "data_kind", "digits", "names", "resolve_backend", "synthetic", "toy", "traits"]
