"""Image folders and .npy latent folders read through a torch DataLoader (the `torch` data backend;
`dali.py` is the other one). Which files a folder holds and their labels: layout.py (class
subfolders give labels, a flat folder gets label 0); how a file is decoded: images.py (its bit depth,
mode and EXIF orientation). Images are resized on the shorter side, cropped, optionally mirrored and
scaled to [-1, 1]; the crop position and the mirror come with the index (order.augment_table, the draws DALI
uses too), so they are seeded and resumable; a plain index gives the centre crop. Latents are
returned as stored.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

from ..errors import DataError
from .images import IMAGE_EXTENSIONS, open_image
from .layout import LATENT_EXTENSIONS, scan

__all__ = ["IMAGE_EXTENSIONS", "LATENT_EXTENSIONS", "ImageFolderDataset", "LatentFolderDataset", "scan"]


def _files(root, manifest, extensions):
    if manifest is not None:
        return [tuple(f) for f in manifest["files"]], manifest["classes"]
    return scan(root, extensions)


class ImageFolderDataset(Dataset):
    def __init__(self, root: str, image_size: int, channels: int = 3, files: list[tuple[str, int]] | None = None,
                 manifest: dict | None = None):
        self.root = Path(root)
        if files is not None:
            self.files, self.classes = files, sorted({label for _, label in files})
        else:
            self.files, self.classes = _files(root, manifest, IMAGE_EXTENSIONS)
        self.channels, self.size = channels, image_size
        self.resize = transforms.Resize(image_size)
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item):
        """`item`: an index, or (index, mirror, crop_x, crop_y) with the crop position in [0, 1]."""
        i, mirror, cx, cy = item if isinstance(item, tuple) else (item, 0.0, 0.5, 0.5)
        path, label = self.files[i]
        try:
            im = self.resize(open_image(self.root / path, self.channels))  # true bit depth, EXIF orientation
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for truncated or corrupt files
            raise DataError(f"cannot decode {self.root / path} ({type(e).__name__}); it changed after "
                             f"`fasttrain data prepare` was run: run it again") from None
        w, h = im.size
        left, top = round(cx * (w - self.size)), round(cy * (h - self.size))  # (0.5, 0.5): CenterCrop's offsets
        im = im.crop((left, top, left + self.size, top + self.size))
        if mirror:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = self.to_tensor(im)  # [-1, 1]; a 16-bit grey image (one float band) fills every channel
        return x.expand(self.channels, -1, -1).contiguous() if x.shape[0] != self.channels else x, torch.tensor(label)


class LatentFolderDataset(Dataset):
    """Precomputed latents, one .npy per sample (e.g. VAE latents from `fasttrain data prepare --encoder`)."""

    def __init__(self, root: str, manifest: dict | None = None):
        self.root = Path(root)
        self.files, self.classes = _files(root, manifest, LATENT_EXTENSIONS)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def shape(self) -> tuple[int, ...]:
        return tuple(np.load(self.root / self.files[0][0], mmap_mode="r").shape)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        try:
            return torch.from_numpy(np.load(self.root / path).astype(np.float32)), torch.tensor(label)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {self.root / path} ({type(e).__name__}); run `fasttrain data prepare` "
                             f"again") from None
