"""VAE latents cached per aspect-ratio bucket: `fasttrain data prepare IMAGES --vae VAE --buckets`, and the
data kind `bucket_latents` that trains on them, one bucket per batch.

Each readable image goes to its bucket (buckets.py: sd-scripts' resolutions around `--image-size`,
`--min-bucket-reso`, `--max-bucket-reso`, `--bucket-reso-steps`, which the VAE's downsampling must
divide), is scaled and centre-cropped into it and encoded; its posterior mean and std ([2C, h/f, w/f],
as encode.py keeps them) go into that bucket's one packed array, OUT/bucket-WxH.npy (np.load with
mmap_mode="r" reads it). OUT/fasttrain-bucket-latents.json indexes the buckets (their files, rows'
source files and labels) and holds the latents' record in the manifest's format (source, base size,
the VAE's identity, per-channel statistics: vae.latent_record reads it). Training with
`data.name=bucket_latents data.root=OUT` batches each bucket's rows in buckets.py's seeded, rank-split,
exactly resumable order, drawing from the posteriors (latents.py); sampling stays at the square base.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, InvalidInput
from .buckets import BucketImages, BucketStream, bucket_table
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register

INDEX = "fasttrain-bucket-latents.json"


def encode_buckets(image_manifest: dict, out, vae_folder: str, subfolder: str | None, settings: dict,
                   batch_size: int = 64, device=None, progress: bool = True) -> dict:
    """Encode the manifest's images bucket by bucket into OUT (module docstring); returns the index."""
    from tqdm.auto import tqdm

    from ..pretrained.vae import encode, identity, load_vae

    root, out = Path(image_manifest["root"]), Path(out)
    files = [tuple(f) for f in image_manifest["files"]]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vae = load_vae(vae_folder, subfolder, device)
    vid = identity(vae, vae_folder, subfolder)
    f = int(vid["downsample"])
    if settings["steps"] % f or settings["min"] % f:
        raise InvalidInput(f"--bucket-reso-steps {settings['steps']} and --min-bucket-reso {settings['min']} must be "
                           f"multiples of the VAE's downsampling {f}")
    table = bucket_table(str(root), files, settings)
    if not table["items"]:
        raise DataError(f"{root}: every image is smaller than every bucket")
    ds = BucketImages(str(root), files, table, int(vae.config.in_channels))
    out.mkdir(parents=True, exist_ok=True)
    C = int(vae.config.latent_channels)
    s1, s2, n_px = np.zeros(C), np.zeros(C), 0
    buckets = []
    bar = tqdm(total=len(table["items"]), desc="encoding", unit="image", disable=not progress)
    for b, (bw, bh) in enumerate(table["resolutions"]):
        rows = [r for r, item in enumerate(table["items"]) if item[1] == b]
        if not rows:
            continue
        name = f"bucket-{bw}x{bh}.npy"
        tmp = out / f".{name}.{os.getpid()}.tmp"
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(rows), 2 * C, bh // f, bw // f))
        for i in range(0, len(rows), batch_size):
            x = torch.stack([ds[(r, 0.0, 0.5, 0.5)][0] for r in rows[i:i + batch_size]]).to(device)
            mean, std = encode(vae, x)
            block = torch.cat([mean, std], 1).float().cpu().numpy()
            arr[i:i + len(block)] = block
            m64, s64 = block[:, :C].astype(np.float64), block[:, C:].astype(np.float64)
            s1 += m64.sum((0, 2, 3))  # E[z] = E[mean], E[z²] = E[mean² + std²] (encode.channel_stats)
            s2 += (m64**2 + s64**2).sum((0, 2, 3))
            n_px += block.shape[0] * block.shape[2] * block.shape[3]
            bar.update(len(block))
        arr.flush()
        del arr
        os.replace(tmp, out / name)
        items = [table["items"][r] for r in rows]
        buckets.append({"file": name, "reso": [bw, bh], "shape": [2 * C, bh // f, bw // f],
                        "sources": [files[it[0]][0] for it in items], "labels": [int(files[it[0]][1]) for it in items]})
    bar.close()
    mean = s1 / n_px
    index = {"buckets": buckets, "count": sum(len(b["labels"]) for b in buckets), "classes": image_manifest["classes"],
             "latents": {"source": str(root.resolve()), "image_size": settings["base"], "vae": vid,
                         "posterior": "mean_std", "channels": C, "channel_mean": mean.tolist(),
                         "channel_std": np.sqrt(np.maximum(s2 / n_px - mean**2, 0)).tolist(),
                         "skipped_images": image_manifest["bad"] + [[s, "smaller than every bucket"]
                                                                    for s in table["small"]],
                         "buckets": settings}}
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, out / INDEX)
    return index


class PackedBuckets(Dataset):
    """Row k of the global table → (the stored posterior [2C, h, w], label); each bucket's array mapped
    once per worker."""

    def __init__(self, root, index: dict):
        self.root, self.index = Path(root), index
        self.where = [(b, k) for b, bucket in enumerate(index["buckets"]) for k in range(len(bucket["labels"]))]
        self._arrays: dict[int, np.ndarray] = {}

    def __len__(self):
        return len(self.where)

    def __getitem__(self, item):
        b, k = self.where[item[0] if isinstance(item, tuple) else item]
        if b not in self._arrays:
            self._arrays[b] = np.load(self.root / self.index["buckets"][b]["file"], mmap_mode="r")
        return torch.from_numpy(np.array(self._arrays[b][k])), torch.tensor(self.index["buckets"][b]["labels"][k])

    def __getstate__(self):
        return {**self.__dict__, "_arrays": {}}


def read_index(root) -> dict:
    path = Path(root) / INDEX
    if not path.is_file():
        raise DataError(f"data.root {root} holds no {INDEX}: write it with `fasttrain data prepare IMAGES --vae VAE "
                        f"--buckets --latents-out {root}`")
    index = json.loads(path.read_text())
    for b in index["buckets"]:
        try:
            shape = np.load(Path(root) / b["file"], mmap_mode="r").shape
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map {Path(root) / b['file']} ({type(e).__name__}): encode again") from None
        if shape != (len(b["labels"]), *b["shape"]):
            raise DataError(f"{Path(root) / b['file']} holds {shape}, its index says "
                            f"{(len(b['labels']), *b['shape'])}: encode again")
    return index


@register("bucket_latents")
class BucketLatents(DataKind):
    traits = Traits(images=True, pixels=False, resident=False, needs_root=True, latents=True, sized_by_config=False)

    def build(self, d, at: Placement, backend: str):
        from ..pretrained.vae import latent_record
        from .latents import LatentStream

        index = read_index(d.root)
        record = latent_record(index["latents"], d.latent_norm)
        f = int(index["latents"]["vae"]["downsample"])
        # the table buckets.py orders: row k = (k, bucket, latent w, latent h); one "bucket" per array
        items = []
        for b, bucket in enumerate(index["buckets"]):
            items += [[len(items) + k, b, bucket["shape"][2], bucket["shape"][1]] for k in range(len(bucket["labels"]))]
        table = {"resolutions": [[b["shape"][2], b["shape"][1]] for b in index["buckets"]], "items": items}
        s = BucketStream(PackedBuckets(d.root, index), table, d.batch_size, at.seed, at.device, d.num_workers, at.rank,
                         at.world_size, flip=False, where=d.root)
        base = index["latents"]["image_size"] // f
        info = DataInfo(record["channels"], base, len(index["classes"]), index["count"], record,
                        list(index["classes"]), fixed_shape=False)  # one shape per bucket
        return LatentStream(s, record, at.seed, at.rank), info

    def reference(self, cfg, spec, ref_path, n):
        """FID: the source images (or --ref) at the square base size, decoded samples' size; no held-out
        latents for bits/dim (they come in several shapes)."""
        from .reference import latent_reference

        class _NoRoot:  # latent_reference reads no latent folder then
            def __init__(self, d):
                self._d = d

            def __getattr__(self, key):
                return None if key == "root" else getattr(self._d, key)

        ref = latent_reference(spec, _NoRoot(cfg.data), ref_path, n)
        return Reference(ref.train, None, ref.source)

    def reference_images(self, cfg, spec, ref_path, n):
        from .reference import latent_images

        return latent_images(spec, ref_path, n)
