"""What the folder kinds share (image_folder.py, latent_folder.py): the checked file list of a folder
(its manifest, manifest.py) and the stream that reads it, NVIDIA DALI (dali.py) or a torch DataLoader
(loader.py), in the same seeded order (order.py)."""
from __future__ import annotations

import sys

from ..errors import DataError, InvalidInput
from . import dali
from .kinds import DataArgs
from .loader import LoaderStream
from .manifest import build_manifest, load_manifest


def check_folder_args(a: DataArgs, name: str) -> None:
    if not a.root:
        raise InvalidInput(f"data.root must name a folder when data.name={name}")
    if a.channels not in (1, 3):
        raise InvalidInput(f"data.channels must be 1 (grey) or 3 (RGB) for image folders, got {a.channels}")


def folder_manifest(root: str, manifest_path: str | None) -> dict:
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


def stream(what: str, ds, files: list, a: DataArgs, backend: str, augment):
    """Batches of `ds` (DataLoader) or of `files` (DALI, `backend` = "dali"); `what`: DALI's reader,
    "images" or "latents"; `augment`: (flip, random crop) for the DataLoader, None for none."""
    if backend == "dali":
        return dali.DaliStream(what, a.root, files, a.batch_size, image_size=a.image_size, channels=a.channels,
                               seed=a.seed, rank=a.rank, world_size=a.world_size, device=a.device,
                               num_threads=max(1, a.num_workers), crop=a.crop, flip=a.flip)
    return LoaderStream(ds, a.batch_size, a.seed, a.device, a.num_workers, a.rank, a.world_size, augment)
