"""Images/s of the two folder loaders on 256×256 JPEGs at equal worker counts: DALI (decode and
augment in `W` threads; nvJPEG "mixed" decoding on a GPU) against a torch DataLoader (PIL decode and
torchvision transforms in `W` worker processes). Both resize, crop 256×256, flip and normalise.

    python bench/data_throughput.py [--n 512] [--workers 1 2] [--epochs 2]

Writes bench/results/data-<device>.{json,md}.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import numpy as np
import torch
from PIL import Image

from fasttrain.config import DataConfig
from fasttrain.data import build_data, dali


def make_jpegs(root: Path, n: int, side: int = 320) -> Path:
    """Photo-like test images: smooth colour fields plus fine texture, JPEG quality 90."""
    if root.is_dir() and len(list(root.rglob("*.jpg"))) >= n:
        return root
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        low = rng.random((side // 32, side // 32, 3))
        img = np.kron(low, np.ones((32, 32, 1)))
        img = 0.8 * img + 0.2 * rng.random((side, side, 3))
        Image.fromarray((img * 255).astype(np.uint8)).save(d / f"{i:05d}.jpg", quality=90)
    return root


def rate(stream, images: int) -> float:
    next(stream)  # warm-up: workers, pipeline build
    seen, t0 = 0, time.perf_counter()
    while seen < images:
        x, _ = next(stream)
        seen += x.shape[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return seen / (time.perf_counter() - t0)


def main() -> None:
    ap = _env.Parser()
    ap.add_argument("--n", type=_env.count(32), default=512, help="images (at least one batch of 32)")
    ap.add_argument("--workers", type=_env.count(), nargs="+", default=[1, 2])
    ap.add_argument("--epochs", type=_env.count(), default=2)
    ap.add_argument("--dir", default="/tmp/fasttrain-bench-jpegs")
    args = ap.parse_args()
    if not dali.available():
        sys.exit("NVIDIA DALI is not installed (pip install 'fasttrain[dali]')")
    root = make_jpegs(Path(args.dir), args.n)
    from fasttrain.data.manifest import MANIFEST, prepare

    if not (root / MANIFEST).is_file():
        prepare(root)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for w in args.workers:
        r = {"workers": w}
        for backend in ("dali", "torch"):
            s, _ = build_data(DataConfig(name="folder", batch_size=32, root=str(root), image_size=256,
                                         backend=backend, num_workers=w), device=device, seed=0)
            r[backend] = rate(s, args.epochs * args.n)
            del s
        r["ratio"] = r["dali"] / r["torch"]
        rows.append(r)
        print(f"workers {w}: DALI {r['dali']:.0f} img/s, DataLoader {r['torch']:.0f} img/s, ratio {r['ratio']:.2f}")
    info = {"torch": torch.__version__, "python": platform.python_version(), "cores": torch.get_num_threads(),
            "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    import nvidia.dali

    info["dali"] = nvidia.dali.__version__
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "images": args.n, "source_side": 320, "output_side": 256, "rows": rows}
    lines = [f"# Folder loaders, 320² JPEG → 256² crops, batch 32, {device}", "",
             f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "| workers | DALI img/s | DataLoader img/s | DALI / DataLoader |", "|---|---|---|---|"]
    lines += [f"| {r['workers']} | {r['dali']:.0f} | {r['torch']:.0f} | {r['ratio']:.2f} |" for r in rows]
    with _env.Results() as res:
        res.text(f"data-{device}.json", json.dumps(out, indent=2))
        res.text(f"data-{device}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
