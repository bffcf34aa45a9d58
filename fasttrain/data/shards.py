"""The `shards` data kind: images (with labels, and captions where a folder has them) in WebDataset tar
shards, each rank reading only its share of one global order, resumed by seeking.

`fasttrain data prepare ROOT --shards OUT [--shard-size N]` writes the folder's readable images (as
their manifest lists them, manifest.py) into OUT/shard-NNNNNN.tar with the `webdataset` package's
TarWriter: sample i is key %08d with its file's bytes under its extension, `cls` (the label) and `txt`
(ROOT/…/name.txt beside the image, where there is one); each shard is written under a temporary name
and renamed; OUT/fasttrain-shards.json indexes them (shard_index.py: names, counts, bytes, sha256, each
sample's offset) with the classes.

Training (`data.name=shards`) reads them as shard_reader.py does: the global order of an epoch comes
from the index (shard_index.global_order, blocks of data.shuffle_buffer), rank r takes its g ≡ r (mod W)
samples and reads their bytes alone, through a DataLoader (data.num_workers) that splits them again
between its workers. The position is (epoch, this rank's slots in it): a resume on W' ranks starts at
slot pos·W/W' (order.Position) and seeks there. The checkpoint keeps a fingerprint of the shard files
(names and sizes); a resume on another shard set is refused, as is a shard whose size differs from the
index when the stream starts. A sample without an image or a label, or whose image does not decode, is
replaced by the next sample of its shard (shard_reader.py: the same on every rank count), counted and
named on stderr. Images are resized, cropped and flipped as folder.py does, with per-sample draws
(order.augment_table) taken by the sample's global position.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms

from ..errors import DataError, InvalidInput
from .images import open_image
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register
from .shard_index import INDEX, ShardIndex, entry_of, write_index
from .shard_reader import ShardLoader, ShardSamples, Undecodable

__all__ = ["INDEX", "IMAGE_KEYS", "ShardImages", "Shards", "shard_stream", "write_shards"]
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
        shards.append(entry_of(out / name))
        bar.update(len(part))
    bar.close()
    index = {"kind": "images", "shards": shards, "count": len(files), "classes": manifest["classes"],
             "source": str(root.resolve())}
    write_index(out, index)
    return index


class ShardImages(ShardSamples):
    """Samples of an image shard set → (x [C, S, S] in [-1, 1], label); item (i, mirror, crop_x, crop_y)."""

    needs = (IMAGE_KEYS, ("cls",))

    def __init__(self, index: ShardIndex, image_size: int, channels: int = 3):
        super().__init__(index)
        self.size, self.channels = image_size, channels
        self.resize = transforms.Resize(image_size)
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def decode(self, s: dict, extra):
        """As folder.py's ImageFolderDataset: shorter side resized, crop at (cx, cy), mirror, [-1, 1]."""
        mirror, cx, cy = extra if extra else (0.0, 0.5, 0.5)
        key = next(k for k in IMAGE_KEYS if k in s)
        try:
            im = self.resize(open_image(io.BytesIO(s[key]), self.channels))
            label = int(s["cls"])
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for truncated or corrupt images
            raise Undecodable(f"cannot decode {key} ({type(e).__name__})") from None
        w, h = im.size
        left, top = round(cx * (w - self.size)), round(cy * (h - self.size))
        im = im.crop((left, top, left + self.size, top + self.size))
        if mirror:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = self.to_tensor(im)
        x = x.expand(self.channels, -1, -1).contiguous() if x.shape[0] != self.channels else x
        return x, torch.tensor(label)


def shard_stream(ds: ShardSamples, d, at: Placement, augment=None) -> ShardLoader:
    """The stream of a shard kind's samples `ds` for the `data` section `d` (its batch, shuffle block and
    loader workers), built `at`; `augment`: (flip, random crop) for images."""
    return ShardLoader(ds, d.batch_size, at, d.shuffle_buffer, d.num_workers, augment)


@register("shards")
class Shards(DataKind):
    traits = Traits(images=True, pixels=True, resident=False, needs_root=True)

    def build(self, d, at: Placement, backend: str):
        _webdataset("data.name=shards")
        if d.channels not in (1, 3):
            raise InvalidInput(f"data.channels must be 1 (grey) or 3 (RGB) for shards, got {d.channels}")
        s = ShardIndex(d.root, kind="images")
        ds = ShardImages(s, d.image_size, d.channels)
        stream = shard_stream(ds, d, at, (d.flip, d.crop == "random"))
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
        return ReferenceImages(_first_images(ShardIndex(root, kind="images"), spec, n), str(root))


def _first_images(s: ShardIndex, spec, n: int):
    """The first n samples of the shards in their written order, centre-cropped, unflipped (an
    undecodable one replaced as in training)."""
    ds = ShardImages(s, spec.image_size, spec.channels)
    for i in range(min(n, s.count)):
        yield ds[i][0]
