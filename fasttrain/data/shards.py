"""The `shards` data kind: images (with labels, and captions where a folder has them) in WebDataset tar
shards, streamed with a seeded shuffle buffer and an exact resume position on any number of ranks.

`fasttrain data prepare ROOT --shards OUT [--shard-size N]` writes the folder's readable images (as
their manifest lists them, manifest.py) into OUT/shard-NNNNNN.tar with the `webdataset` package's
TarWriter: sample i is key %08d with its file's bytes under its extension, `cls` (the label) and `txt`
(ROOT/…/name.txt beside the image, where there is one); OUT/fasttrain-shards.json indexes the shards
(name, sample count, bytes) and the classes.

The order is the same whatever the number of ranks, as for folders (order.py): epoch e reads the shards
in a permutation seeded by (seed, e), their samples (webdataset's tar expansion and key grouping) pass a
shuffle buffer of `data.shuffle_buffer` seeded by (seed, e) (webdataset's `shuffle` with our rng), and
the g-th sample of that global stream belongs to rank g mod W, each rank taking n // W per epoch. Every
rank reads every shard's bytes (the order needs the whole stream) and decodes only its own samples. The
position is (epoch, this rank's slots in it): a resume on W' ranks starts at slot pos·W/W' (Position),
replaying the epoch's stream from its start without decoding, so it continues the global order exactly.
The checkpoint keeps a fingerprint of the shard files (names and sizes); a resume on another shard set
is refused, as is a shard whose size differs from the index when the stream starts.

Bad members: a truncated or unreadable shard (tar errors: every rank sees them alike) skips the rest of
that shard; a sample without an image or a label is dropped before the rank split; an image that does
not decode is skipped by the rank that owns it (it takes its next slot). Each is counted and named once
on stderr (`skipped`, per stream). Images are resized, cropped and flipped as folder.py does, with the
same per-sample draws (order.augment_table).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sys
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms

from .. import seeds
from ..errors import DataError, InvalidInput
from .images import open_image
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register
from .order import Position, augment_table

INDEX = "fasttrain-shards.json"
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp")


def _webdataset(what: str):
    from .. import optional

    return optional.webdataset(what)


def write_shards(manifest: dict, out, shard_size: int = 1000, progress: bool = True) -> dict:
    """The manifest's files as tar shards in `out` (each written under a temporary name, then renamed)
    and their index; returns the index."""
    from tqdm.auto import tqdm

    wds = _webdataset("data prepare --shards")
    if shard_size < 1:
        raise InvalidInput(f"--shard-size must be >= 1, got {shard_size}")
    root, out = Path(manifest["root"]), Path(out)
    files = [tuple(f) for f in manifest["files"]]
    if not files:
        raise DataError(f"{root} holds no readable images to shard")
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    bar = tqdm(total=len(files), desc="sharding", unit="image", disable=not progress)
    for k, lo in enumerate(range(0, len(files), shard_size)):
        name, part = f"shard-{k:06d}.tar", files[lo:lo + shard_size]
        tmp = out / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f, wds.TarWriter(f) as w:
            for i, (rel, label) in enumerate(part, lo):
                path = root / rel
                sample = {"__key__": f"{i:08d}", path.suffix.lower().lstrip("."): path.read_bytes(), "cls": str(label)}
                if path.with_suffix(".txt").is_file():
                    sample["txt"] = path.with_suffix(".txt").read_text()
                w.write(sample)
        os.replace(tmp, out / name)
        shards.append({"name": name, "count": len(part), "bytes": (out / name).stat().st_size})
        bar.update(len(part))
    bar.close()
    index = {"shards": shards, "count": len(files), "classes": manifest["classes"], "source": str(root.resolve())}
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)
    return index


class ShardSet:
    """The shards under ROOT as their index lists them, checked against the files on disk."""

    def __init__(self, root):
        self.root = Path(root)
        path = self.root / INDEX
        if not path.is_file():
            raise DataError(f"data.root {root} holds no {INDEX}: write shards with `fasttrain data prepare IMAGES "
                            f"--shards {root}`")
        self.index = json.loads(path.read_text())
        self.names = [s["name"] for s in self.index["shards"]]
        self.count, self.classes = int(self.index["count"]), list(self.index["classes"])
        for s in self.index["shards"]:
            p = self.root / s["name"]
            if not p.is_file():
                raise DataError(f"shard {p} is listed in {path} but missing: write the shards again")
            if p.stat().st_size != s["bytes"]:
                raise DataError(f"shard {p} has {p.stat().st_size} bytes, its index says {s['bytes']}: it changed "
                                f"since `data prepare --shards`; write the shards again")
        self.fingerprint = hashlib.sha256(json.dumps([[s["name"], s["bytes"]] for s in self.index["shards"]])
                                          .encode()).hexdigest()[:16]

    def samples(self, order: list[str], on_error) -> object:
        """Valid samples (an image and a label) of the shards in `order`: webdataset's tar expansion and
        key grouping; tar errors and incomplete samples go to `on_error(where, why)` and are skipped."""
        from webdataset.tariterators import group_by_keys, tar_file_expander

        current = {"shard": None}

        def sources():
            for name in order:
                current["shard"] = name
                with open(self.root / name, "rb") as f:
                    yield {"url": name, "stream": f}

        def handler(exn) -> bool:  # webdataset's handler protocol: True = go on with the next member/shard
            on_error(current["shard"], f"{type(exn).__name__}: {str(exn.args[0]) if exn.args else ''}")
            return True

        for s in group_by_keys(tar_file_expander(sources(), handler=handler), handler=handler):
            if "cls" not in s or not any(k in s for k in IMAGE_KEYS):
                members = sorted(k for k in s if not k.startswith("__"))
                on_error(f"{s.get('__url__')}:{s.get('__key__')}", f"incomplete sample (members {members})")
                continue
            yield s


class ShardStream(Position):
    """Batches (x [B, C, S, S] in [-1, 1], labels) of this rank's share of the global shard order."""

    def __init__(self, shards: ShardSet, batch_size: int, seed: int, image_size: int, channels: int = 3,
                 device="cpu", rank: int = 0, world_size: int = 1, buffer: int = 1000, flip: bool = True,
                 random_crop: bool = False):
        self.shards, self.batch_size, self.seed = shards, batch_size, seed
        self.size, self.channels = image_size, channels
        self.device, self.rank, self.world_size, self.buffer = torch.device(device), rank, world_size, buffer
        self.flip, self.random_crop = flip, random_crop
        self.per_rank = shards.count // world_size
        if batch_size > self.per_rank:
            raise DataError(f"data.batch_size {batch_size} is larger than one rank's share of {shards.root}: "
                            f"{shards.count} samples over {world_size} rank(s)")
        self.epoch, self.pos = 0, 0
        self.skipped: list[str] = []
        self._it = None
        self.resize = transforms.Resize(image_size)
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    # -- the order ---------------------------------------------------------------------------------
    def global_stream(self, epoch: int):
        """Epoch `epoch`'s samples in the global order (module docstring), undecoded."""
        from webdataset.filters import shuffle

        perm = torch.randperm(len(self.shards.names),
                              generator=torch.Generator().manual_seed(seeds.derive(self.seed, "data", epoch)))
        order = [self.shards.names[i] for i in perm.tolist()]
        rng = random.Random(seeds.derive(self.seed, "data", epoch, 1))
        return shuffle(bufsize=self.buffer, initial=self.buffer, rng=rng)(self.shards.samples(order, self._note))

    def _note(self, where: str, why: str) -> None:
        self.skipped.append(f"{where}: {why}")
        if self.rank == 0 or why.startswith("cannot decode"):
            print(f"fasttrain: shards: skipped {where} ({why}); {len(self.skipped)} skipped so far", file=sys.stderr)

    def _own(self):
        """(epoch, slot after, x, label) of this rank's samples from the saved position on."""
        epoch, pos = self.epoch, self.pos
        while True:
            aug = augment_table(self.per_rank, self.seed, epoch, self.rank, self.flip, self.random_crop)
            slot = 0
            for g, s in enumerate(self.global_stream(epoch)):
                if slot >= self.per_rank:
                    break
                if g % self.world_size != self.rank:
                    continue
                slot += 1
                if slot <= pos:  # replayed up to the saved position: read, never decoded
                    continue
                x = self._decode(s, aug[slot - 1].tolist())
                if x is not None:
                    yield epoch, slot, x, int(s["cls"])
            epoch, pos = epoch + 1, 0

    def _decode(self, s: dict, aug) -> torch.Tensor | None:
        """As folder.py's ImageFolderDataset: shorter side resized, crop at (cx, cy), mirror, [-1, 1]."""
        mirror, cx, cy = aug
        key = next(k for k in IMAGE_KEYS if k in s)
        try:
            im = self.resize(open_image(io.BytesIO(s[key]), self.channels))
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for truncated or corrupt images
            self._note(f"{s['__url__']}:{s['__key__']}.{key}", f"cannot decode ({type(e).__name__})")
            return None
        w, h = im.size
        left, top = round(cx * (w - self.size)), round(cy * (h - self.size))
        im = im.crop((left, top, left + self.size, top + self.size))
        if mirror:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = self.to_tensor(im)
        return x.expand(self.channels, -1, -1).contiguous() if x.shape[0] != self.channels else x

    # -- the stream --------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = self._own()
        xs, ys = [], []
        for _ in range(self.batch_size):
            epoch, slot, x, y = next(self._it)
            xs.append(x)
            ys.append(y)
        self.epoch, self.pos = (epoch + 1, 0) if slot >= self.per_rank else (epoch, slot)
        return torch.stack(xs).to(self.device), torch.tensor(ys, dtype=torch.long).to(self.device)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "shards": self.shards.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if "shards" in state and state["shards"] != self.shards.fingerprint:
            raise DataError(f"the shards under {self.shards.root} are not those the checkpoint read (fingerprint "
                            f"{state['shards']} then, {self.shards.fingerprint} now): refusing to resume on another "
                            f"shard set (restore it, or start over with --restart)")
        super().load_state_dict(state)

    def _restart(self) -> None:
        self._it = None


@register("shards")
class Shards(DataKind):
    traits = Traits(images=True, pixels=True, resident=False, needs_root=True)

    def build(self, d, at: Placement, backend: str):
        _webdataset("data.name=shards")
        if d.channels not in (1, 3):
            raise InvalidInput(f"data.channels must be 1 (grey) or 3 (RGB) for shards, got {d.channels}")
        s = ShardSet(d.root)
        stream = ShardStream(s, d.batch_size, at.seed, d.image_size, d.channels, at.device, at.rank, at.world_size,
                             d.shuffle_buffer, d.flip, d.crop == "random")
        return stream, DataInfo(d.channels, d.image_size, len(s.classes), s.count, None, s.classes)

    def reference(self, cfg, spec, ref_path, n):
        """--ref (a folder), else the first n samples of the shards in their written order, centre-cropped."""
        if ref_path is not None:
            return super().reference(cfg, spec, ref_path, n)
        images = self.reference_images(cfg, spec, None, n)
        xs = list(images.items or ())
        x = torch.stack(xs) if xs else None
        return Reference(x, x, images.source)

    def reference_images(self, cfg, spec, ref_path, n):
        """`reference`'s images, decoded as they go."""
        from .reference import ReferenceImages, folder_images

        if ref_path is not None:
            return folder_images(ref_path, spec, cfg.data, n)
        root = cfg.data.root
        if not root or not (Path(root) / INDEX).is_file():
            return ReferenceImages(None, f"none (the shards {root!r} are gone: pass --ref PATH)")
        return ReferenceImages(_first_images(ShardSet(root), spec, n), str(root))


def _first_images(s, spec, n: int):
    """The first n decodable samples of the shards in their written order, centre-cropped, unflipped."""
    st = ShardStream(s, 1, 0, spec.image_size, spec.channels, world_size=1, buffer=1)
    count = 0
    for sample in s.samples(s.names, st._note):
        x = st._decode(sample, (0.0, 0.5, 0.5))
        if x is not None:
            count += 1
            yield x
        if count >= n:  # before the next sample is read (its errors would be noted)
            return
