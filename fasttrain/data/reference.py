"""The real data evaluations compare with, read from folders: the first n items of an image (or latent)
folder, resized like the training data, and a VAE-latent run's reference (its source images for FID,
its latents' posterior means for bits/dim). Each data kind chooses (kinds.py, `DataKind.reference`)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidInput
from .folder import ImageFolderDataset, LatentFolderDataset
from .kinds import Reference
from .manifest import IMAGE_EXTENSIONS, load_manifest, scan


def folder_reference(cfg, spec, root: str | None, n: int) -> Reference:
    """The folder `root` (the run's data.root unless --ref named another), or none when it is gone."""
    if not root or not Path(root).is_dir():
        return Reference(None, None, f"none (the training folder {root!r} is gone: pass --ref PATH)")
    x = folder_items(root, spec, cfg.data, n)
    return Reference(x, x, str(root))


def folder_items(root: str, spec, d, n: int) -> torch.Tensor:
    """The first n items of a folder (images unflipped, resized like the training data)."""
    latents = spec.traits.latents
    manifest = load_manifest(root, d.manifest if root == d.root else None)
    if latents:
        ds = LatentFolderDataset(root, manifest)
    else:
        files = [tuple(f) for f in manifest["files"]] if manifest else scan(root, IMAGE_EXTENSIONS)[0]
        ds = ImageFolderDataset(root, spec.image_size, spec.channels, files=files)
    items = [ds[i][0] for i in range(min(n, len(ds)))]
    if not items:
        raise InvalidInput(f"reference {root} holds no {'.npy latents' if latents else 'images'}")
    x = torch.stack(items)
    if tuple(x.shape[1:]) != spec.shape:
        raise InvalidInput(f"reference {root} holds items of shape {tuple(x.shape[1:])}, the model makes {spec.shape}")
    return x


def latent_reference(spec, d, ref_path: str | None, n: int) -> Reference:
    """A VAE-latent run: images for FID (`--ref`, else the folder the latents were encoded from) at the
    size the VAE decodes to, and the latents' posterior means, normalised as in training, for bits/dim."""
    from .latents import prepare_batch

    rec = spec.latents
    root = ref_path or rec.get("source")
    size = rec.get("image_size") or spec.image_size * (rec.get("vae") or {}).get("downsample", 1)
    train, source = None, f"none (the images {root!r} are gone: pass --ref PATH)"
    if root and Path(root).is_dir():
        manifest = load_manifest(root)
        files = [tuple(f) for f in manifest["files"]] if manifest else scan(root, IMAGE_EXTENSIONS)[0]
        ds = ImageFolderDataset(root, size, 3, files=files)
        train, source = torch.stack([ds[i][0] for i in range(min(n, len(ds)))]), str(root)
    test = None
    if d.root and Path(d.root).is_dir():
        lat = LatentFolderDataset(d.root, load_manifest(d.root, d.manifest))
        test = prepare_batch(torch.stack([lat[i][0] for i in range(min(n, len(lat)))]), rec)
    return Reference(train, test, source)
