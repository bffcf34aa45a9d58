"""Aspect-ratio buckets for image folders (`data.buckets=true`), with sd-scripts' semantics
(library/model_util.py `make_bucket_resolutions`, library/train_util.py `BucketManager.select_bucket`),
as SDXL and NovelAI trained:

  resolutions  the square side ⌊√(S²)/step⌋·step for S = `data.image_size`, and for every width
               w = min, min + step, … ≤ max the height h = min(max, ⌊S²/w / step⌋·step) when h ≥ min,
               both (w, h) and (h, w) (`data.min_bucket_reso`, `max_bucket_reso`, `bucket_reso_steps`)
  selection    an image of size (W, H) goes to its own size if that is a bucket, else to the bucket of
               the nearest aspect ratio; it is scaled so that it covers the bucket (its height when it
               is wider than the bucket, else its width; rounded as int(x + 0.5)) and cropped to it, at
               the centre or (`data.crop=random`) at a seeded position; its bucket, scaled size and crop
               box are recorded in ROOT/fasttrain-buckets.json, with the settings and the file list
  too small    an image whose sides are both below `data.min_bucket_reso` is left out and reported (one
               line naming the first files): it would only be blown up

Batches: every batch comes from one bucket. Epoch e shuffles each bucket's images (seeded by (seed, e,
bucket)), cuts them into batches of `data.batch_size` (a bucket's remainder waits for the next epoch's
shuffle), and shuffles the list of batches (seeded by (seed, e)); rank r of W takes the batches r, r + W,
…, the same number each. The order of batches is thus the same on any number of ranks, and the position
(epoch, this rank's batches) resumes exactly, on another rank count too (order.Position). Flips and
random crops are drawn per batch from (seed, e, the batch's global index).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms

from .. import seeds
from ..errors import DataError, InvalidInput
from .images import describe, open_image
from .order import Position

TABLE = "fasttrain-buckets.json"


def resolutions(base: int, min_reso: int, max_reso: int, steps: int) -> list[tuple[int, int]]:
    """(width, height) of every bucket, sorted (sd-scripts' make_bucket_resolutions, max_reso = (base, base))."""
    if steps < 1 or min_reso < 1 or max_reso < min_reso:
        raise InvalidInput(f"bad bucket settings: data.min_bucket_reso {min_reso}, data.max_bucket_reso {max_reso}, "
                           f"data.bucket_reso_steps {steps} (need 1 <= min <= max, step >= 1)")
    area = base * base
    resos = {(int(math.sqrt(area) // steps) * steps,) * 2}
    w = min_reso
    while w <= max_reso:
        h = min(max_reso, int((area // w) // steps) * steps)
        if h >= min_reso:
            resos |= {(w, h), (h, w)}
        w += steps
    resos.discard((0, 0))
    return sorted(resos)


def select(width: int, height: int, resos: list[tuple[int, int]]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the bucket (w, h), the scaled image size (w, h)) of an image (sd-scripts' select_bucket with
    upscaling allowed): its own size if it is a bucket, else the nearest aspect ratio (the first on a tie)."""
    ar = width / height
    reso = (width, height)
    if reso not in resos:
        reso = min(resos, key=lambda r: abs(r[0] / r[1] - ar))
    scale = reso[1] / height if ar > reso[0] / reso[1] else reso[0] / width  # cover the bucket
    return reso, (int(width * scale + 0.5), int(height * scale + 0.5))


def bucket_table(root: str, files: list, settings: dict) -> dict:
    """Every image's bucket and scaled size (read from ROOT/fasttrain-buckets.json when its settings and
    file list match, else computed from the images' sizes and written there); too-small images left out."""
    path = Path(root) / TABLE
    key = hashlib.sha256(json.dumps([settings, [list(f) for f in files]]).encode()).hexdigest()[:16]
    if path.is_file():
        try:
            t = json.loads(path.read_text())
            if t.get("key") == key:
                return t
        except ValueError:
            pass
    resos = resolutions(settings["base"], settings["min"], settings["max"], settings["steps"])
    items, small = [], []
    for i, (rel, _) in enumerate(files):
        (w, h), _mode = describe(Path(root) / rel)  # after the EXIF orientation, as training decodes it
        if w < settings["min"] and h < settings["min"]:
            small.append(f"{rel} ({w}×{h})")
            continue
        reso, size = select(w, h, resos)
        items.append([i, resos.index(reso), size[0], size[1]])
    t = {"key": key, "settings": settings, "resolutions": [list(r) for r in resos], "items": items, "small": small}
    tmp = path.with_name(f".{TABLE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(t))
        os.replace(tmp, path)
    except OSError:  # a read-only data folder: the table is computed again next time
        tmp.unlink(missing_ok=True)
    return t


def epoch_batches(table: dict, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The global list of epoch `epoch`'s batches (rows of the table's items), each from one bucket."""
    by_bucket: dict[int, list[int]] = {}
    for row, item in enumerate(table["items"]):
        by_bucket.setdefault(item[1], []).append(row)
    batches = []
    for b in sorted(by_bucket):
        rows = torch.tensor(by_bucket[b])
        g = torch.Generator().manual_seed(seeds.derive(seed, "data", epoch, b + 1))
        rows = rows[torch.randperm(len(rows), generator=g)].tolist()
        batches += [rows[i:i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seeds.derive(seed, "data", epoch)))
    return [batches[i] for i in order.tolist()]


class BucketImages(Dataset):
    """One image scaled and cropped into its bucket: item (row, mirror, crop_x, crop_y), crop in [0, 1]."""

    def __init__(self, root: str, files: list, table: dict, channels: int):
        self.root, self.files, self.table, self.channels = Path(root), files, table, channels
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.table["items"])

    def __getitem__(self, item):
        row, mirror, cx, cy = item
        i, b, w, h = self.table["items"][row]
        bw, bh = self.table["resolutions"][b]
        path, label = self.files[i]
        try:
            im = open_image(self.root / path, self.channels).resize((w, h), Image.Resampling.BILINEAR)
        except (OSError, ValueError, SyntaxError) as e:
            raise DataError(f"cannot decode {self.root / path} ({type(e).__name__}); it changed after "
                            f"`fasttrain data prepare` was run: run it again") from None
        left, top = round(cx * (w - bw)), round(cy * (h - bh))  # the recorded box: (0.5, 0.5) is the centre
        im = im.crop((left, top, left + bw, top + bh))
        if mirror:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = self.to_tensor(im)
        return (x.expand(self.channels, -1, -1).contiguous() if x.shape[0] != self.channels else x), torch.tensor(label)


class _BatchOrder(Sampler):
    """This rank's batches from a saved position on, each with its items' augmentation draws."""

    def __init__(self, stream: BucketStream):
        self.s, self.epoch, self.pos = stream, stream.epoch, stream.pos

    def __iter__(self):
        s, epoch, pos = self.s, self.epoch, self.pos
        while True:
            batches = epoch_batches(s.table, s.batch_size, s.seed, epoch)
            per_rank = len(batches) // s.world_size
            for k in range(pos, per_rank):
                j = s.rank + k * s.world_size  # the batch's global index: its draws do not depend on W
                g = torch.Generator().manual_seed(seeds.derive(s.seed, "augment", epoch, j))
                aug = torch.rand(len(batches[j]), 3, generator=g, dtype=torch.float64)
                aug[:, 0] = (aug[:, 0] < 0.5).double() if s.flip else 0.0
                if not s.random_crop:
                    aug[:, 1:] = 0.5
                yield [(row, *a) for row, a in zip(batches[j], aug.tolist())]
            epoch, pos = epoch + 1, 0

    def __len__(self):
        return 2**62


class BucketStream(Position):
    """Batches (x [B, C, h, w] of one bucket, labels) through a DataLoader: `dataset[(row, mirror, crop_x,
    crop_y)]` is item `row` of `table` (an image folder's BucketImages, or bucket_latents.py's arrays)."""

    def __init__(self, dataset, table: dict, batch_size: int, seed: int, device="cpu", num_workers: int = 0,
                 rank: int = 0, world_size: int = 1, flip: bool = True, random_crop: bool = False, where: str = ""):
        self.table, self.batch_size, self.seed, self.device = table, batch_size, seed, torch.device(device)
        self.rank, self.world_size, self.flip, self.random_crop = rank, world_size, flip, random_crop
        self.num_workers, self.epoch, self.pos = num_workers, 0, 0
        self.per_rank = len(epoch_batches(table, batch_size, seed, 0)) // world_size
        if self.per_rank < 1:
            raise DataError(f"data.batch_size {batch_size} leaves {where} no batch per rank over {world_size} "
                            f"rank(s): its buckets hold {_counts(table)} images")
        self.dataset = dataset
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(DataLoader(self.dataset, batch_sampler=_BatchOrder(self), num_workers=self.num_workers,
                                       pin_memory=self.device.type == "cuda"))
        x, y = next(self._it)
        self.pos += 1  # batches per epoch are the same every epoch: Σ_b ⌊n_b / B⌋
        while self.pos >= self.per_rank:
            self.epoch, self.pos = self.epoch + 1, self.pos - self.per_rank
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _restart(self):
        self._it = None


def _counts(table: dict) -> str:
    counts: dict[str, int] = {}
    for _, b, _, _ in table["items"]:
        w, h = table["resolutions"][b]
        counts[f"{w}×{h}"] = counts.get(f"{w}×{h}", 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def settings_of(d) -> dict:
    """The bucket settings of the `data` section: its image_size is the base side (sd-scripts' resolution)."""
    return {"base": d.image_size, "min": d.min_bucket_reso, "max": d.max_bucket_reso, "steps": d.bucket_reso_steps}


def sides(d) -> list[int]:
    """Every side a bucket of the `data` section's settings has (configure.py checks each suits the network)."""
    st = settings_of(d)
    return sorted({s for r in resolutions(st["base"], st["min"], st["max"], st["steps"]) for s in r})


def build(d, at, files: list) -> BucketStream:
    """The bucketed stream of an image folder (image_folder.py with data.buckets=true): the `data` section
    `d` and where it is built (`at`: kinds.Placement)."""
    say = (lambda line: print(line, file=sys.stderr)) if at.rank == 0 else (lambda line: None)
    settings = settings_of(d)
    table = bucket_table(d.root, files, settings)
    small = table["small"]
    if small:
        say(f"fasttrain: buckets: left out {len(small)} image(s) smaller than every bucket (both sides below "
            f"data.min_bucket_reso {settings['min']}): {', '.join(small[:3])}{' ...' if len(small) > 3 else ''}")
    if not table["items"]:
        raise DataError(f"data.root {d.root}: every image is smaller than every bucket")
    say(f"fasttrain: buckets: {_counts(table)}")
    return BucketStream(BucketImages(d.root, files, table, d.channels), table, d.batch_size, at.seed, at.device,
                        d.num_workers, at.rank, at.world_size, d.flip, d.crop == "random", where=d.root)
