"""A shard set's index and its order: what `data prepare --shards` records about WebDataset tar shards
(shards.py: images; latent_shards.py: captioned VAE latents), the checks of the index and of one sample
(each in one function: `check_index`, `check_sample`), and the one global sample order of an epoch.

The index, OUT/fasttrain-shards.json (format 2): `kind` ("images" or "captioned_latents"), `count`, `classes`,
`source`, and per shard its name, sample `count`, `bytes`, `sha256` and `spans`: each sample's [offset,
size] in the tar (from its first member's header to the end of its last member's padded data), so a
reader seeks to a sample and reads its bytes alone. An index without spans (format 1, written before
them) is read: its spans are found by reading the tar headers (a few hundred bytes per member), once per
process, and `data prepare --shards` again records them.

The order (mosaicml/streaming's promise, `streaming/base/shuffle/py1b.py`'s shape: shards shuffled, then
samples shuffled within fixed-size blocks): epoch e concatenates the shards in a permutation seeded by
(seed, e) and permutes each block of `block` consecutive samples (data.shuffle_buffer) with draws seeded by
(seed, e). It is computed from the index alone, the same for any number of ranks; the g-th sample of it
belongs to rank g mod W, each rank taking n // W (`rank_order`), so a global batch of B·W samples is the
same set whatever W is, and a resume seeks to its slot without reading what came before it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

from .. import seeds
from ..errors import DataError

INDEX = "fasttrain-shards.json"
FORMAT = 2
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext: key = name up to the first dot


def _split(name: str) -> tuple[str, str] | None:
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def scan_spans(path: Path) -> list[list[int]]:
    """Each sample's [offset, size] in the tar at `path`, read from its member headers (members of one
    sample are consecutive and share a key, as webdataset's TarWriter writes them)."""
    spans, key = [], None
    with tarfile.open(path, mode="r:") as t:
        for m in t:
            if not m.isfile():
                continue
            split = _split(m.name)
            end = m.offset_data + (m.size + 511) // 512 * 512
            if split is not None and split[0] == key:
                spans[-1][1] = end - spans[-1][0]
            else:
                key = None if split is None else split[0]
                spans.append([m.offset, end - m.offset])
    return spans


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_of(path: Path) -> dict:
    """A shard's index entry: name, count, bytes, sha256, spans."""
    spans = scan_spans(path)
    return {"name": path.name, "count": len(spans), "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "spans": spans}


def write_index(out: Path, index: dict) -> None:
    """The index, whole or not at all (a temporary name, then renamed)."""
    tmp = out / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, **index}))
    os.replace(tmp, out / INDEX)


def check_index(root: Path, index: dict) -> None:
    """What an index must hold, against the files beside it: every listed shard present with the size
    the index says, the counts adding up (one line each, naming the file and saying what to do)."""
    path = root / INDEX
    shards = index.get("shards") if isinstance(index, dict) else None
    ok = (isinstance(shards, list) and shards and isinstance(index.get("count"), int)
          and all(isinstance(s, dict) and isinstance(s.get("name"), str) and "/" not in s["name"]
                  and isinstance(s.get("bytes"), int) and isinstance(s.get("count"), int) for s in shards))
    if not ok:  # an edited index or another tool's file: its fields checked before any is used
        raise DataError(f"{path} is not a shard index (it needs \"shards\": [{{name, count, bytes}}, ...] and "
                        f"\"count\"): write the shards again with `fasttrain data prepare IMAGES --shards {root}`")
    for s in index["shards"]:
        p = root / s["name"]
        if not p.is_file():
            raise DataError(f"shard {p} is listed in {path} but missing: write the shards again")
        if p.stat().st_size != s["bytes"]:
            raise DataError(f"shard {p} has {p.stat().st_size} bytes, its index says {s['bytes']}: it changed "
                            f"since `data prepare --shards`; write the shards again")
        if "spans" in s and len(s["spans"]) != s["count"]:
            raise DataError(f"{path}: shard {s['name']} lists {len(s['spans'])} sample offsets for {s['count']} "
                            f"samples: write the shards again")
    if sum(s["count"] for s in index["shards"]) != index["count"]:
        raise DataError(f"{path}: its shards hold {sum(s['count'] for s in index['shards'])} samples, its count "
                        f"says {index['count']}: write the shards again")


def check_sample(sample: dict, needs: tuple[tuple[str, ...], ...]) -> str | None:
    """Why a sample cannot be trained on (None: it can): each group of `needs` names members of which one
    must be present (("jpg", "png", ...) for an image, ("cls",) for a label)."""
    for group in needs:
        if not any(k in sample for k in group):
            members = sorted(k for k in sample if not k.startswith("__"))
            return f"incomplete sample (members {members}; needs {'/'.join(group)})"
    return None


def parse_sample(buf: bytes) -> dict:
    """A sample's members {extension: bytes} (and `__key__`) from its bytes (a span of the tar)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(buf), mode="r:") as t:
        for m in t:
            split = _split(m.name) if m.isfile() else None
            if split is None:
                continue
            out.setdefault("__key__", split[0])
            out[split[1]] = t.extractfile(m).read()
    return out


class ShardIndex:
    """The shards under ROOT as their index lists them, checked against the files on disk (`check_index`);
    `spans[k]` [count, 2] int64 per shard, `starts` the global id of each shard's first sample."""

    def __init__(self, root, kind: str | None = None):
        self.root = Path(root)
        path = self.root / INDEX
        if not path.is_file():
            raise DataError(f"data.root {root} holds no {INDEX}: write shards with `fasttrain data prepare IMAGES "
                            f"--shards {root}`")
        try:
            self.index = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{path} is not valid JSON ({str(e).splitlines()[0][:80]}): write the shards "
                            f"again") from None
        check_index(self.root, self.index)
        self.kind = self.index.get("kind", "images")
        if kind is not None and self.kind != kind:
            raise DataError(f"{self.root} holds shards of {self.kind}, not {kind}: prepare them with "
                            f"`fasttrain data prepare` for the data.name you train")
        shards = self.index["shards"]
        self.names = [s["name"] for s in shards]
        self.counts = np.array([s["count"] for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.count, self.classes = int(self.index["count"]), list(self.index.get("classes", []))
        if all("spans" in s for s in shards):
            self.spans = [np.asarray(s["spans"], dtype=np.int64).reshape(-1, 2) for s in shards]
        else:  # format 1: the spans from the tar headers
            print(f"fasttrain: {path} records no sample offsets (written by an older fasttrain): reading them from "
                  f"the tar headers; `fasttrain data prepare IMAGES --shards {root}` again records them",
                  file=sys.stderr)
            self.spans = []
            for n in self.names:
                try:
                    self.spans.append(np.asarray(scan_spans(self.root / n), dtype=np.int64).reshape(-1, 2))
                except tarfile.TarError as e:
                    raise DataError(f"shard {self.root / n} is not a whole tar ({e}): write the shards again") from None
            for name, sp, c in zip(self.names, self.spans, self.counts):
                if len(sp) != c:
                    raise DataError(f"shard {self.root / name} holds {len(sp)} samples, its index says {c}: write "
                                    f"the shards again")
        # names and sizes (the same fingerprint as before spans were recorded: old checkpoints resume)
        self.fingerprint = hashlib.sha256(json.dumps([[s["name"], s["bytes"]] for s in shards]).encode()
                                          ).hexdigest()[:16]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, sample within it) of global sample id i."""
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        return k, int(i - self.starts[k])

    def span_bytes(self, ids) -> int:
        """The bytes of samples `ids` (global ids): what reading them costs."""
        flat = np.concatenate([sp[:, 1] for sp in self.spans])
        return int(flat[np.asarray(ids, dtype=np.int64)].sum())


def global_order(counts: np.ndarray, seed: int, epoch: int, block: int) -> np.ndarray:
    """Epoch `epoch`'s global sample ids (module docstring): shards permuted, samples permuted within
    blocks of `block` consecutive positions."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    perm = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seeds.derive(seed, "data", epoch)))
    ids = np.concatenate([np.arange(starts[k], starts[k] + counts[k]) for k in perm.tolist()])
    rng = np.random.default_rng(seeds.derive(seed, "data", epoch, 1))
    for lo in range(0, len(ids), block):
        ids[lo:lo + block] = rng.permutation(ids[lo:lo + block])
    return ids


def rank_order(counts: np.ndarray, seed: int, epoch: int, block: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's sample ids of epoch `epoch`: every world_size-th of the global order, n // world_size."""
    n = int(counts.sum())
    return global_order(counts, seed, epoch, block)[rank::world_size][: n // world_size]
