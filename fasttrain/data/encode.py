"""`fasttrain data prepare IMAGES --vae FOLDER`: every readable image → its VAE posterior, one .npy each.

Each file holds float32 [2C, h, w]: the posterior mean (channels 0..C-1) and standard deviation
(C..2C-1), as EDM2's and fast-DiT's latent data sets keep them, so that training can draw a fresh
z ~ N(mean, std²) per epoch instead of seeing one fixed draw (data/latents.py). Images are read as
training reads them (shorter side resized to --image-size, centre crop, [-1, 1]), in batches, on the
GPU when there is one.

The latents folder's manifest (fasttrain-manifest.json, the format of manifest.py) lists the files
with the images' labels and classes, and its section "latents" records the source folder, the image
size, the VAE's identity (folder, config and weights hashes, scaling and shift factors: vae.identity)
and the per-channel mean and std of the sampled latents, which `data.latent_norm` reads.

With `mask` (`data prepare --vae --mask alpha|file`, masks.py) each image's loss mask goes through the
image's resize and crop, then to the latent grid as sd-scripts resizes it (F.interpolate, mode="area"), and
is written as NAME.mask.npy (float32 [1, h, w]) before NAME.npy; the manifest's "latents" section records
the mode ("mask") with the counts of images without alpha and with all-zero masks. Without it nothing
changes: a folder prepared before masks existed trains as it did.

Resumable: each file is written under a temporary name and renamed, so a file that exists is whole;
a rerun of the same command skips those. The settings are written first (fasttrain-encoding.json,
removed when the manifest is written) and checked on a rerun, so that one folder never mixes two
encodings.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from ..errors import DataError
from . import masks
from .folder import ImageFolderDataset
from .manifest import MANIFEST

STATE = "fasttrain-encoding.json"


def default_out(root: str | Path) -> Path:
    """Where latents go without --latents-out: a sibling folder ROOT-latents."""
    root = Path(root).resolve()
    return root.parent / f"{root.name}-latents"


def _settings_of(out: Path) -> dict | None:
    """The encoding settings a folder already holds (in progress, or finished), None if none."""
    if (out / STATE).is_file():
        return json.loads((out / STATE).read_text())
    if (out / MANIFEST).is_file():
        info = json.loads((out / MANIFEST).read_text()).get("latents") or {}
        if info.get("vae"):
            return {**{k: info.get(k) for k in ("source", "image_size", "vae")},
                    "mask": (info.get("mask") or {}).get("mode")}
    return None


def _claim(out: Path, settings: dict) -> None:
    """Refuse a folder that holds another encoding; record ours before the first file is written."""
    old = _settings_of(out)
    if old is None and any(out.rglob("*.npy")):
        raise DataError(f"--latents-out {out} already holds .npy files that are not from `data prepare --vae`: "
                        f"choose an empty folder")
    if old is not None:
        for key in ("source", "image_size"):
            if old.get(key) != settings[key]:
                raise DataError(f"--latents-out {out} holds latents of another {key.replace('_', ' ')} "
                                f"({old.get(key)!r}): choose another folder or delete it")
        if settings.get("mask") and old.get("mask") and old["mask"] != settings["mask"]:
            raise DataError(f"--latents-out {out} holds the masks of --mask {old['mask']}: choose another folder or "
                            f"delete it")
        for key in ("config_sha256", "weights_sha256"):
            if (old.get("vae") or {}).get(key) != settings["vae"][key]:
                raise DataError(f"--latents-out {out} holds latents of another VAE ({key.split('_')[0]} differs): "
                                f"choose another folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    (out / STATE).write_text(json.dumps(settings, indent=1))


def _save(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


def channel_stats(paths: list[Path], channels: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of z ~ N(mean, std²) over all files and pixels, exactly (no draws):
    E[z] = E[mean], E[z²] = E[mean² + std²]."""
    s1, s2, n = np.zeros(channels), np.zeros(channels), 0
    for p in paths:
        a = np.load(p, mmap_mode="r").astype(np.float64)
        mean, std = a[:channels], a[channels:]
        s1 += mean.sum((1, 2))
        s2 += (mean**2 + std**2).sum((1, 2))
        n += mean.shape[1] * mean.shape[2]
    m = s1 / n
    return m.tolist(), np.sqrt(np.maximum(s2 / n - m**2, 0)).tolist()


def encode_with_vae(image_manifest: dict, out: str | Path, vae_folder: str, subfolder: str | None = None,
                    image_size: int = 256, batch_size: int = 64, device=None, num_workers: int | None = None,
                    progress: bool = True, mask: str = "none") -> dict:
    """Encode the manifest's readable images into `out` (resuming where an earlier pass stopped) and
    write and return the latents' manifest; `mask` (masks.MODES): each image's loss mask too."""
    from ..pretrained.vae import encode, identity, load_vae

    root, out = Path(image_manifest["root"]), Path(out)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    files = [(str(rel), int(label)) for rel, label in image_manifest["files"]]
    if not files:
        raise DataError(f"{root} holds no readable images to encode")
    targets = [out / Path(rel).with_suffix(".npy") for rel, _ in files]
    seen: dict[Path, str] = {}
    for (rel, _), t in zip(files, targets):
        if t in seen:
            raise DataError(f"{seen[t]} and {rel} would both be encoded to {t.name}: rename one of them")
        seen[t] = rel
    report = masks.scan(root, files, mask, progress) if mask != "none" else None  # bad masks: before any encoding
    if report:
        masks.say_counts(report, mask, lambda line: print(line, file=sys.stderr))
    vae = load_vae(vae_folder, subfolder, device)
    settings = {"source": str(root.resolve()), "image_size": image_size, "vae": identity(vae, vae_folder, subfolder)}
    if mask != "none":
        settings["mask"] = mask
    _claim(out, settings)
    todo = [i for i, t in enumerate(targets)
            if not t.is_file() or (mask != "none" and not masks.latent_mask_file(t).is_file())]
    if num_workers is None:  # image decoding in worker processes feeds a GPU; on CPU the VAE is the cost
        num_workers = min(8, os.cpu_count() or 1) if device.type == "cuda" else 0
    ds = ImageFolderDataset(str(root), image_size, vae.config.in_channels, files=files, mask=mask)
    loader = DataLoader(Subset(ds, todo), batch_size=batch_size, num_workers=num_workers,
                        pin_memory=device.type == "cuda")
    bar = tqdm(total=len(files), initial=len(files) - len(todo), desc="encoding", unit="image", disable=not progress)
    k = 0
    for x, _, *m in loader:
        mean, std = encode(vae, x.to(device, non_blocking=True))
        grid = masks.to_grid(m[0], mean.shape[-2:]).numpy() if m else None  # sd-scripts' area resize
        for j, arr in enumerate(torch.cat([mean, std], 1).cpu().numpy()):
            if grid is not None:  # the mask first: a latent that exists has its mask
                _save(masks.latent_mask_file(targets[todo[k]]), grid[j])
            _save(targets[todo[k]], arr)
            k += 1
        bar.update(len(x))
    bar.close()
    C = int(vae.config.latent_channels)
    mean, std = channel_stats(targets, C)
    shape = list(np.load(targets[0], mmap_mode="r").shape) if targets else []
    counts: dict[str, int] = {}
    for _, label in files:
        counts[str(label)] = counts.get(str(label), 0) + 1
    if report is not None:
        settings["mask"] = {"mode": mask, "resize": "area", "no_alpha": len(report["no_alpha"]),
                            "all_zero": len(report["all_zero"])}
    manifest = {"root": str(out.resolve()), "kind": "latents", "classes": image_manifest["classes"],
                "num_files": len(files), "counts": counts, "sizes": {str(shape): len(files)},
                "files": [[str(t.relative_to(out)), label] for t, (_, label) in zip(targets, files)], "bad": [],
                "latents": {**settings, "posterior": "mean_std", "channels": C, "channel_mean": mean,
                            "channel_std": std, "skipped_images": image_manifest["bad"]}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (out / STATE).unlink(missing_ok=True)
    return manifest
