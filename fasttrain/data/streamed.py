"""What the folder kinds share (image_folder.py, latent_folder.py): the checked file list of a folder
(its manifest, manifest.py) and the stream that reads it, NVIDIA DALI (dali.py) or a torch DataLoader
(loader.py), in the same seeded order (order.py)."""
from __future__ import annotations

import sys

from ..errors import DataError, InvalidInput
from ..parallel.cpu import check_workers
from . import dali
from .loader import LoaderStream
from .manifest import build_manifest, left_out, load_manifest, summary


def check_folder_args(d, name: str) -> None:
    """The `data` section's folder fields, for a folder kind built without configure's checks (tests, benchmarks)."""
    if not d.root:
        raise InvalidInput(f"data.root must name a folder when data.name={name}")
    if d.channels not in (1, 3):
        raise InvalidInput(f"data.channels must be 1 (grey) or 3 (RGB) for image folders, got {d.channels}")


def folder_manifest(d, at) -> dict:
    """The folder's manifest (built now if it has none) and its file list checked against the batch; what it
    decided and what it leaves out said once, by rank 0 (the other ranks read the same folder)."""
    say = _stderr if at.rank == 0 else _quiet
    if at.rank == 0:
        check_workers(d.num_workers)
    m = load_manifest(d.root, d.manifest)
    if m is None:
        say(f"fasttrain: checking {d.root} (run `fasttrain data prepare {d.root}` once to cache this)")
        m = build_manifest(d.root)
    say(f"fasttrain: data: {summary(m)}")
    odd = set(m.get("other_layout_files", []))
    unreadable = [b[0] for b in m["bad"] if b[0] not in odd]
    if unreadable:
        shown = ", ".join(unreadable[:3])
        say(f"fasttrain: skipping {len(unreadable)} unreadable file(s): {shown}{' ...' if len(unreadable) > 3 else ''}")
    if odd:
        shown = ", ".join(sorted(odd)[:3])
        say(f"fasttrain: leaving out {len(odd)} file(s) whose shape or dtype differs from the folder's: {shown}"
            f"{' ...' if len(odd) > 3 else ''} (`fasttrain data prepare {d.root}` lists each)")
    if not m["files"]:
        raise DataError(f"data.root {d.root!r} holds no readable files")
    n = len(m["files"])
    if n // at.world_size < d.batch_size:  # before a loader says so without the files left out
        left = f"; left out: {left_out(m)}" if m["bad"] else ""
        raise DataError(f"data.batch_size {d.batch_size} is larger than one rank's share of {d.root}: {n} "
                        f"usable file(s) over {at.world_size} rank(s){left}")
    return m


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _quiet(line: str) -> None:
    pass


def stream(what: str, ds, files: list, d, at, backend: str, augment):
    """Batches of `ds` (DataLoader) or of `files` (DALI, `backend` = "dali") for the `data` section `d`,
    built `at` (kinds.Placement); `what`: DALI's reader, "images" or "latents"; `augment`: (flip, random
    crop) for the DataLoader, None for none."""
    if backend == "dali":
        return dali.DaliStream(what, d.root, files, d.batch_size, image_size=d.image_size, channels=d.channels,
                               seed=at.seed, rank=at.rank, world_size=at.world_size, device=at.device,
                               num_threads=max(1, d.num_workers), crop=d.crop, flip=d.flip)
    return LoaderStream(ds, d.batch_size, at.seed, at.device, d.num_workers, at.rank, at.world_size, augment)
