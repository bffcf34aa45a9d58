"""Built-in data sets that need no download: scikit-learn's bundled handwritten digits, 2-D toys, and
synthetic Gaussian "latents" of any shape (for throughput benchmarks: no decoding, no files); each
registered as a data kind (kinds.py) that lives on the training device (memory.py)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidInput
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register
from .memory import MemoryStream

TOYS = ("moons", "8gaussians", "checkerboard")


DIGITS_SIZE = 1797  # sklearn's load_digits()


def digits(image_size: int = 8, split: str = "train", holdout: int = 400, seed: int = 0):
    """sklearn's 1797 real 8×8 digits (values 0..16) scaled to [-1, 1] as [N, 1, S, S] float32.
    The last `holdout` images of a fixed permutation form the test split."""
    from sklearn.datasets import load_digits

    if split not in ("train", "test", "all"):
        raise InvalidInput(f"split must be train, test or all, got {split!r}")
    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 8.0 - 1.0)[:, None]
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    x, y = x[perm], y[perm]
    if split == "train":
        x, y = x[:-holdout], y[:-holdout]
    elif split == "test":
        x, y = x[-holdout:], y[-holdout:]
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False).clamp(-1, 1)
    return x.contiguous(), y


def toy(name: str, n: int = 20000, seed: int = 0) -> torch.Tensor:
    """[n, 2] float32 samples of a 2-D toy distribution, scaled to roughly unit variance."""
    rng = np.random.default_rng(seed)
    if name == "moons":
        from sklearn.datasets import make_moons

        x, _ = make_moons(n_samples=n, noise=0.05, random_state=seed)
        x = (x - np.array([0.5, 0.25])) / np.array([0.87, 0.5])
    elif name == "8gaussians":
        centers = np.array([(math.cos(a), math.sin(a)) for a in np.arange(8) * math.pi / 4]) * 1.5
        x = centers[rng.integers(0, 8, n)] + 0.1 * rng.standard_normal((n, 2))
    elif name == "checkerboard":
        # 4×4 board on [-2, 2]², every other square filled (FFJORD's toy).
        x1 = rng.uniform(-2, 2, n)
        x2 = rng.uniform(0, 1, n) + rng.integers(0, 2, n) * 2 - 2 + (np.floor(x1) % 2)
        x = np.stack([x1, x2], 1) / 1.15
    else:
        raise InvalidInput(f"unknown toy data set {name!r}; choose from {', '.join(TOYS)}")
    return torch.from_numpy(x.astype(np.float32))


def synthetic(channels: int, image_size: int, n: int = 4096, num_classes: int = 10, seed: int = 0):
    """[n, C, S, S] float32 N(0, 1) tensors with random labels: the shape of real latents, no content."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, image_size, image_size, generator=g), torch.randint(0, num_classes, (n,),
                                                                                        generator=g)


# -- the built-in data kinds (kinds.py), resident on the training device ----------------------------------
def _split_seed(split: str) -> int:
    return 0 if split == "train" else 1


@register("digits")
class Digits(DataKind):
    traits = Traits(images=True, pixels=True, resident=True, extractor="fasttrain-digits")

    def channels(self, d) -> int:
        return 1

    def check(self, d) -> None:
        super().check(d)
        if d.batch_size >= DIGITS_SIZE:
            raise InvalidInput(f"bad value for 'data.batch_size': {d.batch_size!r} (digits has {DIGITS_SIZE} "
                               f"images, data.holdout={d.holdout} of them held out)")
        if d.holdout > DIGITS_SIZE - d.batch_size:
            raise InvalidInput(f"bad value for 'data.holdout': {d.holdout!r} (digits has {DIGITS_SIZE} images and "
                               f"one batch of data.batch_size={d.batch_size} must stay for training)")

    def resident_items(self, d) -> int:
        return DIGITS_SIZE - d.holdout

    def build(self, d, at: Placement, backend: str):
        x, y = digits(d.image_size, split=at.split, holdout=d.holdout, seed=0)
        return (MemoryStream(x, y, d.batch_size, at.seed, at.device, at.rank, at.world_size),
                DataInfo(1, d.image_size, 10, len(x), class_names=[str(i) for i in range(10)]))

    def reference(self, cfg, spec, ref_path, n):
        if ref_path is not None:
            return super().reference(cfg, spec, ref_path, n)
        test, labels = digits(spec.image_size, "test", holdout=cfg.data.holdout)
        return Reference(digits(spec.image_size, "train", holdout=cfg.data.holdout)[0][:n], test, "digits", labels)

    def reference_images(self, cfg, spec, ref_path, n):
        if ref_path is not None:  # a folder: read as it goes
            from .reference import folder_images

            return folder_images(ref_path, spec, cfg.data, n)
        return super().reference_images(cfg, spec, ref_path, n)


@register("synthetic")
class Synthetic(DataKind):
    traits = Traits(images=True, pixels=False, resident=True)

    def resident_items(self, d) -> int:
        return 4096

    def build(self, d, at: Placement, backend: str):
        x, y = synthetic(d.channels, d.image_size, seed=_split_seed(at.split))
        return (MemoryStream(x, y, d.batch_size, at.seed, at.device, at.rank, at.world_size),
                DataInfo(d.channels, d.image_size, 10, len(x)))

    def reference(self, cfg, spec, ref_path, n):
        if ref_path is not None:
            return super().reference(cfg, spec, ref_path, n)
        return Reference(None, None, "none (synthetic data have nothing to compare with)")

    def reference_images(self, cfg, spec, ref_path, n):
        if ref_path is not None:  # a folder: read as it goes
            from .reference import folder_images

            return folder_images(ref_path, spec, cfg.data, n)
        return super().reference_images(cfg, spec, ref_path, n)


class Toy(DataKind):
    """A 2-D toy distribution (`toy`): flat points, no classes; its reference is its own exact sampler."""
    traits = Traits(images=False, pixels=False, resident=True, sized_by_config=False, conditioning="none")

    def channels(self, d) -> int:
        return 2

    def build(self, d, at: Placement, backend: str):
        x = toy(self.name, seed=_split_seed(at.split))
        y = torch.zeros(len(x), dtype=torch.long)
        return (MemoryStream(x, y, d.batch_size, at.seed, at.device, at.rank, at.world_size),
                DataInfo(2, None, 0, len(x)))

    def reference(self, cfg, spec, ref_path, n):
        if ref_path is not None:
            return super().reference(cfg, spec, ref_path, n)
        return Reference(toy(self.name, n=n, seed=0), toy(self.name, n=n, seed=1), self.name)


for _toy in TOYS:
    register(_toy)(type(f"Toy_{_toy}", (Toy,), {}))
