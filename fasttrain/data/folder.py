"""Image folders and .npy latent folders read through a torch DataLoader (the `torch` data backend;
`dali.py` is the other one). Which files a folder holds and their labels: layout.py (class
subfolders give labels, a flat folder gets label 0); how a file is decoded: images.py (its bit depth,
mode and EXIF orientation). Images are resized on the shorter side, cropped, optionally mirrored and
scaled to [-1, 1]; the crop position and the mirror come with the index (order.augment_table, the draws DALI
uses too), so they are seeded and resumable; a plain index gives the centre crop. Latents are
returned as stored. With a loss mask (`mask`: data.mask, masks.py) an item is (x, label, mask [1, ...]):
the image's mask through the same resize, crop and mirror; a latent's stored NAME.mask.npy.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

from ..errors import DataError
from . import masks
from .images import IMAGE_EXTENSIONS, open_image
from .layout import LATENT_EXTENSIONS, scan

__all__ = ["IMAGE_EXTENSIONS", "LATENT_EXTENSIONS", "ImageFolderDataset", "LatentFolderDataset", "scan"]


def _files(root, manifest, extensions):
    if manifest is not None:
        return [tuple(f) for f in manifest["files"]], manifest["classes"]
    return scan(root, extensions)


class ImageFolderDataset(Dataset):
    def __init__(self, root: str, image_size: int, channels: int = 3, files: list[tuple[str, int]] | None = None,
                 manifest: dict | None = None, mask: str = "none"):
        self.root, self.mask = Path(root), mask
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
        box = (left, top, left + self.size, top + self.size)
        im = im.crop(box)
        if mirror:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = self.to_tensor(im)  # [-1, 1]; a 16-bit grey image (one float band) fills every channel
        x = x.expand(self.channels, -1, -1).contiguous() if x.shape[0] != self.channels else x
        if self.mask == "none":
            return x, torch.tensor(label)
        m = self.resize(masks.open_mask(self.root / path, self.mask)[0]).crop(box)  # the image's own operations
        if mirror:
            m = m.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return x, torch.tensor(label), masks.to_tensor(m)


class LatentFolderDataset(Dataset):
    """Precomputed latents, one .npy per sample (e.g. VAE latents from `fasttrain data prepare --encoder`)."""

    def __init__(self, root: str, manifest: dict | None = None, mask: bool = False):
        self.root, self.mask = Path(root), mask
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
        file = self.root / path
        try:
            x = torch.from_numpy(np.load(file).astype(np.float32))
            if self.mask:  # NAME.mask.npy: [1, h, w] on the latent grid (encode.py)
                file = masks.latent_mask_file(self.root / path)
                return x, torch.tensor(label), torch.from_numpy(np.load(file).astype(np.float32))
            return x, torch.tensor(label)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {file} ({type(e).__name__}); run `fasttrain data prepare` "
                             f"again") from None
