"""A plain image-folder data set read through a torch DataLoader (DALI comes in its own module).

Class subfolders give labels (torchvision's ImageFolder layout); a flat folder gets label 0.
Images are resized on the shorter side, centre-cropped, randomly flipped and scaled to [-1, 1].
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class ImageFolderDataset(Dataset):
    def __init__(self, root: str, image_size: int, channels: int = 3, flip: bool = True):
        root_p = Path(root)
        if not root_p.is_dir():
            raise ValueError(f"data.root {root!r} is not a directory")
        subdirs = sorted(d for d in root_p.iterdir() if d.is_dir())
        if subdirs:
            self.classes = [d.name for d in subdirs]
            files = [(f, i) for i, d in enumerate(subdirs) for f in sorted(d.rglob("*")) if f.suffix.lower() in EXTENSIONS]
        else:
            self.classes = []
            files = [(f, 0) for f in sorted(root_p.iterdir()) if f.suffix.lower() in EXTENSIONS]
        if not files:
            raise ValueError(f"data.root {root!r} holds no images ({', '.join(EXTENSIONS)})")
        self.files = files
        self.mode = "L" if channels == 1 else "RGB"
        ops = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
        if flip:
            ops.append(transforms.RandomHorizontalFlip())
        ops += [transforms.ToTensor(), transforms.Normalize([0.5] * channels, [0.5] * channels)]
        self.transform = transforms.Compose(ops)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        with Image.open(path) as im:
            return self.transform(im.convert(self.mode)), torch.tensor(label)
