"""The real data evaluations compare with, read from folders: the first n items of an image (or latent)
folder, resized like the training data, and a VAE-latent run's reference (its source images for FID,
its latents' posterior means for bits/dim). Each data kind chooses (kinds.py, `DataKind.reference`);
`Reference` is what they hand back."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidInput
from .folder import ImageFolderDataset, LatentFolderDataset
from .manifest import IMAGE_EXTENSIONS, load_manifest, scan


@dataclass
class Reference:
    """Real data to compare with: `train` images for FID, `test` (held out where there is one) for bpd."""
    train: torch.Tensor | None
    test: torch.Tensor | None
    source: str
    test_labels: torch.Tensor | None = None


def folder_reference(cfg, spec, root: str | None, n: int) -> Reference:
    """The folder `root` (the run's data.root unless --ref named another), or none when it is gone."""
    if not root or not Path(root).is_dir():
        return Reference(None, None, f"none (the training folder {root!r} is gone: pass --ref PATH)")
    x = folder_items(root, spec, cfg.data, n)
    return Reference(x, x, str(root))


def folder_items(root: str, spec, d, n: int) -> torch.Tensor:
    """The first n items of a folder (images unflipped, resized like the training data)."""
    items = [x for x in folder_images(root, spec, d, n).items]
    return _checked(torch.stack(items) if items else None, root, spec)


def folder_images(root: str | None, spec, d, n: int) -> ReferenceImages:
    """`folder_items`, read as they go (`ReferenceImages`); none when the folder is gone."""
    if not root or not Path(root).is_dir():
        return ReferenceImages(None, f"none (the training folder {root!r} is gone: pass --ref PATH)")
    manifest = load_manifest(root, d.manifest if root == d.root else None)
    if spec.traits.latents:
        ds = LatentFolderDataset(root, manifest)
    else:
        files = [tuple(f) for f in manifest["files"]] if manifest else scan(root, IMAGE_EXTENSIONS)[0]
        ds = ImageFolderDataset(root, spec.image_size, spec.channels, files=files)
    return ReferenceImages((ds[i][0] for i in range(min(n, len(ds)))), str(root), spec)


def _checked(x: torch.Tensor | None, root, spec) -> torch.Tensor:
    if x is None:
        raise InvalidInput(f"reference {root} holds no {'.npy latents' if spec.traits.latents else 'images'}")
    if tuple(x.shape[1:]) != spec.shape:
        raise InvalidInput(f"reference {root} holds items of shape {tuple(x.shape[1:])}, the model makes {spec.shape}")
    return x


class ReferenceImages:
    """A reference's images one at a time ([C, H, W] in [-1, 1]), handed out `chunks(k)` at a time, so
    that at most k of them are in memory (`items` None: no reference, `source` says why). `spec` given:
    the folder checks of `folder_items` (not empty, the model's shape), on the first chunk."""

    def __init__(self, items: Iterable[torch.Tensor] | None, source: str, spec=None):
        self.items, self.source, self.spec = items, source, spec

    @classmethod
    def held(cls, x: torch.Tensor | None, source: str) -> ReferenceImages:
        """Images already in memory (the built-in sets), in the same chunks."""
        return cls(None if x is None else iter(x), source)

    def chunks(self, k: int) -> Iterator[torch.Tensor]:
        buf, first = [], True
        for x in self.items:
            buf.append(x)
            if len(buf) == k:
                yield self._check(torch.stack(buf), first)
                buf, first = [], False
        if buf or (first and self.spec is not None):
            yield self._check(torch.stack(buf) if buf else None, first)

    def _check(self, x, first: bool):
        return _checked(x, self.source, self.spec) if first and self.spec is not None else x


def latent_reference(spec, d, ref_path: str | None, n: int) -> Reference:
    """A VAE-latent run: images for FID (`--ref`, else the folder the latents were encoded from) at the
    size the VAE decodes to, and the latents' posterior means, normalised as in training, for bits/dim."""
    from .latents import prepare_batch

    images = latent_images(spec, ref_path, n)
    train = None if images.items is None else torch.stack(list(images.items))
    test = None
    if d.root and Path(d.root).is_dir():
        lat = LatentFolderDataset(d.root, load_manifest(d.root, d.manifest))
        test = prepare_batch(torch.stack([lat[i][0] for i in range(min(n, len(lat)))]), spec.latents)
    return Reference(train, test, images.source)


def latent_images(spec, ref_path: str | None, n: int) -> ReferenceImages:
    """`latent_reference`'s images, read as they go."""
    rec = spec.latents
    root = ref_path or rec.get("source")
    size = rec.get("image_size") or spec.image_size * (rec.get("vae") or {}).get("downsample", 1)
    if not (root and Path(root).is_dir()):
        return ReferenceImages(None, f"none (the images {root!r} are gone: pass --ref PATH)")
    manifest = load_manifest(root)
    files = [tuple(f) for f in manifest["files"]] if manifest else scan(root, IMAGE_EXTENSIONS)[0]
    ds = ImageFolderDataset(root, size, 3, files=files)
    return ReferenceImages((ds[i][0] for i in range(min(n, len(ds)))), str(root))
