"""Samples per second per core of the data formats, each read by its stream in the main process
(num_workers=0, one thread: the cost of one core): a folder of 320² JPEGs decoded and cropped to 256²
(DataLoader stream, loader.py), the same JPEGs as WebDataset tar shards (data/shards.py, shuffle buffer
256), the mixed-aspect JPEGs cropped square against aspect-ratio buckets (data/buckets.py: the
cost of bucketing), a folder of per-file .npy VAE latents ([8, 32, 32]: the posterior mean and std of a 256² image
under an SD-style VAE, data prepare --vae's layout), and the same latents packed into one memory-mapped
array (data/packed.py). Variants interleave round by round; the median of the rounds is reported, with
the page cache warm (every file read once before timing).

    python bench/data_formats.py [--images 256] [--latents 2048] [--rounds 5]

Writes bench/results/data-formats-cpu.{json,md}.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import numpy as np
import torch
from data_throughput import make_jpegs
from PIL import Image

from fasttrain.config import DataConfig
from fasttrain.data import build_data


def make_latents(root: Path, n: int, shape=(8, 32, 32)) -> Path:
    if (root / "fasttrain-packed.npy").is_file():
        return root
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / f"{i:06d}.npy", rng.standard_normal(shape).astype(np.float32))
    from fasttrain.data.manifest import prepare
    from fasttrain.data.packed import pack

    prepare(root)
    pack(root, progress=False)
    return root


def make_mixed(root: Path, n: int) -> Path:
    """JPEGs of six aspect ratios (about 320² pixels each) for the bucketing rows."""
    if root.is_dir() and len(list(root.rglob("*.jpg"))) >= n:
        return root
    rng = np.random.default_rng(1)
    shapes = [(320, 320), (448, 256), (256, 448), (384, 288), (288, 384), (512, 192)]
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        low = rng.random((h // 32 + 1, w // 32 + 1, 3))
        img = np.kron(low, np.ones((32, 32, 1)))[:h, :w]
        Image.fromarray(((0.8 * img + 0.2 * rng.random((h, w, 3))) * 255).astype(np.uint8)).save(
            d / f"{i:05d}.jpg", quality=90)
    from fasttrain.data.manifest import prepare

    prepare(root)
    return root


def rate(stream, samples: int) -> float:
    next(stream)
    seen, t0 = 0, time.perf_counter()
    while seen < samples:
        x, _ = next(stream)
        seen += x.shape[0]
    return seen / (time.perf_counter() - t0)


def main() -> None:
    ap = _env.Parser()
    ap.add_argument("--images", type=_env.count(64), default=256)
    ap.add_argument("--latents", type=_env.count(64), default=2048)
    ap.add_argument("--rounds", type=_env.count(), default=5)
    ap.add_argument("--dir", default="/tmp/fasttrain-bench-formats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(args.dir)
    jpegs = make_jpegs(base / "jpegs", args.images)
    from fasttrain.data.manifest import MANIFEST, prepare

    if not (jpegs / MANIFEST).is_file():
        prepare(jpegs)
    lat = make_latents(base / "latents", args.latents)
    shards = base / "shards"
    if not (shards / "fasttrain-shards.json").is_file():
        from fasttrain.data.manifest import load_manifest
        from fasttrain.data.shards import write_shards

        write_shards(load_manifest(str(jpegs)), shards, shard_size=64, progress=False)
    mixed = make_mixed(base / "mixed", args.images)
    t0 = time.perf_counter()
    from fasttrain.data.buckets import TABLE, bucket_table
    from fasttrain.data.manifest import load_manifest

    (mixed / TABLE).unlink(missing_ok=True)
    bucket_table(str(mixed), [tuple(f) for f in load_manifest(str(mixed))["files"]],
                 {"base": 256, "min": 128, "max": 512, "steps": 64})
    table_s = time.perf_counter() - t0  # once per folder and settings: the table is kept beside the images
    bucketed = dict(name="folder", root=str(mixed), image_size=256, buckets=True, min_bucket_reso=128,
                    max_bucket_reso=512, bucket_reso_steps=64)
    variants = {  # name: (build_data arguments, samples per round)
        "mixed-aspect JPEG folder (crop 256²)": (dict(name="folder", root=str(mixed), image_size=256), args.images),
        "mixed-aspect JPEG folder, buckets (base 256)": (bucketed, args.images),
        "JPEG folder (decode, crop 256²)": (dict(name="folder", root=str(jpegs), image_size=256), args.images),
        "JPEG tar shards (webdataset, buffer 256)": (dict(name="shards", root=str(shards), image_size=256,
                                                          shuffle_buffer=256), args.images),
        "latent folder (one .npy per sample)": (dict(name="latents", root=str(lat)), args.latents),
        "packed latents (one memory-mapped array)": (dict(name="packed", root=str(lat)), args.latents),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):  # round 0 warms the page cache and is not kept
        for name, (kw, n) in variants.items():
            s, _ = build_data(DataConfig(batch_size=32, backend="torch", num_workers=0, **kw), seed=r)
            v = rate(s, n)
            if r:
                rates[name].append(v)
    rows = [{"format": k, "samples_per_s": statistics.median(v), "rounds": v} for k, v in rates.items()]
    ref = rows[4]["samples_per_s"]
    for row in rows:
        row["vs_latent_folder"] = row["samples_per_s"] / ref
        print(f"{row['format']}: {row['samples_per_s']:.0f}/s per core ({row['vs_latent_folder']:.2f}x the latent "
              f"folder)")
    from cases import machine

    info = {**machine(), "numpy": np.__version__, "workers": 0}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "batch": 32, "rows": rows, "bucket_table_s": table_s, "bucket_table_images": args.images}
    lines = ["# Data formats: samples/s per core (main process, 1 thread, warm page cache)", "",
             f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "| format | samples/s per core | vs latent folder |", "|---|---|---|"]
    lines += [f"| {r['format']} | {r['samples_per_s']:.0f} | {r['vs_latent_folder']:.2f}x |" for r in rows]
    lines += ["", f"Bucket table (each image's size read once, kept in fasttrain-buckets.json): {table_s:.2f} s for "
              f"{args.images} images."]
    with _env.Results() as res:
        res.text("data-formats-cpu.json", json.dumps(out, indent=2))  # CPU reading only (no GPU in the loop)
        res.text("data-formats-cpu.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    _env.run(main)
