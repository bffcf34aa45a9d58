"""The `packed` data kind: a latent folder's arrays packed into one memory-mapped file, read without a
file open per sample (EDM2 keeps its latents in one zip, many trainers in one np.memmap).

`fasttrain data prepare LATENTS --pack` (or `data prepare IMAGES --vae VAE --pack`) writes beside the
folder's manifest:
  fasttrain-packed.npy    float32 [N, C, h, w], the manifest's files in its order (a plain .npy: np.load
                          with mmap_mode="r" reads it; written under a temporary name, then renamed)
  fasttrain-packed.json   the index: count, shape, labels, the files' names, and a hash of the manifest's
                          file list, so an index that no longer matches its manifest is refused
Training with `data.name=packed data.root=LATENTS` reads rows of the one mapped array (a batch at a time:
`__getitems__`), in the same seeded order as every stream (order.py, through loader.py), with the
latent folder's record (VAE, normalisation, posterior draws: latents.py). The per-file .npy may be
deleted once packed: the packed kind and its reference read only the packed file and the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, InvalidInput
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register
from .latents import LatentStream
from .loader import LoaderStream
from .manifest import MANIFEST, load_manifest

PACKED, INDEX = "fasttrain-packed.npy", "fasttrain-packed.json"


def _files_hash(files) -> str:
    return hashlib.sha256(json.dumps([list(f) for f in files]).encode()).hexdigest()


def pack(root, manifest: dict | None = None, progress: bool = True) -> dict:
    """Pack the .npy latents `manifest` lists (default: ROOT's) into ROOT/fasttrain-packed.npy + index."""
    from tqdm.auto import tqdm

    root = Path(root)
    m = manifest or load_manifest(str(root))
    if m is None or m.get("kind") != "latents":
        raise InvalidInput(f"--pack packs a folder of .npy latents; {root} holds "
                           f"{'no manifest' if m is None else m.get('kind')} (encode images first: --vae)")
    files = [tuple(f) for f in m["files"]]
    if not files:
        raise DataError(f"{root} holds no readable latents to pack")
    shape = tuple(np.load(root / files[0][0], mmap_mode="r").shape)
    tmp = root / f".{PACKED}.{os.getpid()}.tmp"
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(files), *shape))
    try:
        for i, (rel, _) in enumerate(tqdm(files, desc="packing", unit="file", disable=not progress)):
            a = np.load(root / rel, mmap_mode="r")
            if a.shape != shape:
                raise DataError(f"{root / rel} has shape {a.shape}, the folder's latents {shape}: run `fasttrain "
                                f"data prepare {root}` again")
            arr[i] = a
        arr.flush()
    except BaseException:
        del arr
        tmp.unlink(missing_ok=True)
        raise
    del arr
    os.replace(tmp, root / PACKED)
    index = {"count": len(files), "shape": list(shape), "dtype": "float32", "labels": [int(y) for _, y in files],
             "files": [rel for rel, _ in files], "manifest_files_sha256": _files_hash(files)}
    itmp = root / f".{INDEX}.tmp"
    itmp.write_text(json.dumps(index))
    os.replace(itmp, root / INDEX)
    return index


def read_index(root, manifest: dict) -> dict:
    """The packed index of ROOT, checked against its manifest and the array's size (one line each)."""
    root = Path(root)
    if not (root / PACKED).is_file() or not (root / INDEX).is_file():
        raise DataError(f"data.root {root} holds no packed latents ({PACKED}): run `fasttrain data prepare {root} "
                        f"--pack`")
    index = json.loads((root / INDEX).read_text())
    if index.get("manifest_files_sha256") != _files_hash(manifest["files"]):
        raise DataError(f"{root / PACKED} was packed from another file list than {root / MANIFEST} lists: run "
                        f"`fasttrain data prepare {root} --pack` again")
    try:
        arr = np.load(root / PACKED, mmap_mode="r")
    except (OSError, ValueError) as e:  # a truncated file does not map
        raise DataError(f"cannot map {root / PACKED} ({type(e).__name__}: {e}): pack it again") from None
    if arr.shape != (index["count"], *index["shape"]):
        raise DataError(f"{root / PACKED} holds {arr.shape}, its index says {(index['count'], *index['shape'])}: pack "
                        f"it again")
    return index


class PackedDataset(Dataset):
    """Rows of the mapped array with their labels; each worker maps the file once, on first use."""

    def __init__(self, root, index: dict):
        self.path, self.labels = Path(root) / PACKED, torch.tensor(index["labels"], dtype=torch.long)
        self._arr = None

    def _rows(self) -> np.ndarray:
        if self._arr is None:
            self._arr = np.load(self.path, mmap_mode="r")
        return self._arr

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.from_numpy(np.array(self._rows()[i])), self.labels[i]

    def __getitems__(self, idx: list[int]):
        """A batch in one fancy-indexed read (DataLoader calls this when it is defined)."""
        rows = torch.from_numpy(self._rows()[np.asarray(idx)])
        return [(rows[k], self.labels[i]) for k, i in enumerate(idx)]

    def __getstate__(self):  # worker processes map the file themselves
        return {**self.__dict__, "_arr": None}


@register("packed")
class Packed(DataKind):
    traits = Traits(images=True, pixels=False, resident=False, needs_root=True, latents=True, sized_by_config=False)

    def build(self, d, at: Placement, backend: str):
        from ..pretrained.vae import latent_record

        if not d.root:
            raise InvalidInput("data.root must name a folder when data.name=packed")
        m = load_manifest(d.root, d.manifest)
        if m is None:
            raise DataError(f"data.root {d.root} holds no {MANIFEST}: run `fasttrain data prepare {d.root} --pack`")
        index = read_index(d.root, m)
        n = index["count"]
        if n // at.world_size < d.batch_size:
            raise DataError(f"data.batch_size {d.batch_size} is larger than one rank's share of {d.root}: {n} "
                            f"packed latents over {at.world_size} rank(s)")
        shape = index["shape"]
        record = latent_record(m.get("latents"), d.latent_norm)
        c = record["channels"] if record else shape[0]
        if len(shape) != 3 or shape[1] != shape[2]:
            raise DataError(f"packed latents must be [C, S, S] arrays, {d.root}/{PACKED} holds rows of {shape}")
        # the DataLoader whatever data.backend says: DALI's readers open one file per sample
        s = LoaderStream(PackedDataset(d.root, index), d.batch_size, at.seed, at.device, d.num_workers, at.rank,
                         at.world_size)
        info = DataInfo(c, shape[1], len(m["classes"]), n, record, list(m["classes"]))
        return (LatentStream(s, record, at.seed, at.rank) if record else s), info

    def reference(self, cfg, spec, ref_path, n):
        """FID: the images the latents came from (or --ref), as for a latent folder; bits/dim: the first
        n packed posterior means."""
        from .latents import prepare_batch
        from .reference import latent_reference

        ref = latent_reference(spec, _NoRoot(cfg.data), ref_path, n) if spec.latents else Reference(None, None, "")
        test = None
        d = cfg.data
        m = load_manifest(d.root, d.manifest) if d.root and Path(d.root).is_dir() else None
        if m is not None and (Path(d.root) / PACKED).is_file():
            rows = torch.from_numpy(np.array(np.load(Path(d.root) / PACKED, mmap_mode="r")[:n]))
            test = prepare_batch(rows, spec.latents) if spec.latents else rows
        return Reference(ref.train, test, ref.source if spec.latents else str(d.root))

    def reference_images(self, cfg, spec, ref_path, n):
        from .reference import ReferenceImages, latent_images

        return latent_images(spec, ref_path, n) if spec.latents else ReferenceImages(None, "")


class _NoRoot:
    """The data config without its root, so latent_reference reads no latent folder (the packed file
    gives the held-out latents instead)."""

    def __init__(self, d):
        self._d = d

    def __getattr__(self, key):
        return None if key == "root" else getattr(self._d, key)
