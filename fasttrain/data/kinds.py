"""Data kinds: what each `data.name` is, declared once, in a registry like the samplers and weightings.
Every module outside `fasttrain/data/` asks a kind's traits, never its name (tests/test_contracts.py).

    kind = data_kind("digits")
    kind.traits.images, kind.traits.resident, kind.traits.conditioning     # what it is
    stream, info = kind.build(cfg.data, Placement(seed, device, rank), reader)  # batches on the device
    kind.reference(cfg, spec, ref_path, n)                                 # what evaluation compares with
    kind.reference_images(cfg, spec, ref_path, n).chunks(k)               # its images, k at a time

Traits (`Traits`):
  images          samples are [C, S, S] arrays (else flat points: the 2-D toys)
  pixels          their values are image pixels in [-1, 1]: generated samples are clipped to it, bits/dim
                  are discrete (256 levels), FID judges them as images (not latents, not synthetic noise)
  latents         VAE latents: samples are decoded for viewing and judging (the run records the VAE)
  resident        the whole set lives on the training device (memory.py); else streamed from files
                  (DataLoader or DALI), which `data.backend` chooses
  needs_root      read from `data.root`
  sized_by_config the image size is `data.image_size` (else the files decide it)
  conditioning    what a batch's labels are: "class" (class labels; a set without classes has 0 of them),
                  "text" (caption groups into `DataInfo.text_table`: data/captioned.py), "none"
  extractor       the feature extractor `eval.extractor=auto` takes for it (None: by `pixels`)
A new data kind (WebDataset shards, packed latents, text–image pairs) is one module in this package:
a `DataKind` subclass with its traits, `build`, `reference` and `check`, registered with `@register`; its
`build` reads the `data` section whole, so a new option is one field in config.py and the code reading it.
`trainable = False` marks a kind that only describes outputs (decoded VAE samples), not a `data.name`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInput
from ..registry import Registry
from .reference import Reference, ReferenceImages, folder_images, folder_reference

DATA_KINDS = Registry("data set")
register = DATA_KINDS.register


@dataclass(frozen=True)
class Traits:
    images: bool
    pixels: bool
    resident: bool
    needs_root: bool = False
    latents: bool = False
    sized_by_config: bool = True
    conditioning: str = "class"
    extractor: str | None = None


@dataclass(frozen=True)
class Placement:
    """Where a stream is built and for whom, beside the `data` section that a kind reads whole: the run's
    seed (train.seed: the data order and augmentation draws), the device its batches land on, this
    process's rank among `world_size`, the split (train; test: the held-out part where a kind has one), and
    how many batches a step draws before it trains on any (train.grad_accum: a kind whose batches bring
    their caption encodings keeps that many batches' rows on the device, latent_shards.py)."""
    seed: int = 0
    device: torch.device | str = "cpu"
    rank: int = 0
    world_size: int = 1
    split: str = "train"
    batches_per_step: int = 1


@dataclass
class DataInfo:
    channels: int
    image_size: int | None  # None for 2-D toy data
    num_classes: int
    size: int
    latents: dict | None = None  # a latent folder's VAE, normalisation and statistics (vae.latent_record)
    class_names: list | None = None  # the classes' names (folders: the class subfolders), by label
    text: dict | None = None  # captioned kinds: the text encoders' identity and shapes (data/captioned.py)
    text_table: object = None  # captioned kinds: their cached encodings (conditioning.TextTable), not recorded
    captions: list | None = None  # captioned kinds: every image's captions' text (text-encoder LoRA), not recorded
    fixed_shape: bool = True  # every batch has one shape (not with aspect-ratio buckets: a CUDA graph replays one)
    loss_weights: bool = False  # batches carry a per-pixel loss weight after their labels (data.prior: prior.py)


class DataKind:
    """A data set kind (module docstring). Subclasses declare `traits` and implement `build`."""
    name: str = ""
    traits: Traits
    trainable: bool = True
    buckets: bool = False  # takes aspect-ratio buckets (data.buckets, buckets.py)
    masks: bool = False  # takes per-image loss masks (data.mask, masks.py)
    prior: bool = False  # takes DreamBooth class latents (data.prior, prior.py)

    def check(self, d) -> None:
        """What this kind needs of the `data` config group beyond the field types: InvalidInput naming
        the key (configure.py turns it into the config error)."""
        if self.traits.needs_root and not d.root:
            raise InvalidInput(f"bad value for 'data.root': None (a folder is needed for data.name={self.name})")
        if getattr(d, "buckets", False) and not self.buckets:
            raise InvalidInput(f"bad value for 'data.buckets': True (aspect-ratio buckets are for image folders, "
                               f"not data.name={self.name})")
        prior = getattr(d, "prior", None)
        if prior is not None and prior.root is not None and not self.prior:
            raise InvalidInput(f"bad value for 'data.prior.root': {prior.root!r} (prior preservation pairs captioned "
                               f"latents with class latents: data.name=captioned_latents, not {self.name})")
        if getattr(d, "mask", "none") != "none" and not self.masks:
            raise InvalidInput(f"bad value for 'data.mask': {d.mask!r} (loss masks are for image folders "
                               f"(data.name=folder) and latents prepared with `fasttrain data prepare --vae --mask` "
                               f"(latents, captioned_latents), not data.name={self.name})")

    def channels(self, d) -> int:
        """The channels of a sample, as far as the config tells (memory estimates)."""
        return d.channels

    def resident_items(self, d) -> int:
        """How many samples live on the training device at once (0 for streamed kinds)."""
        return 0

    def build(self, d, at: Placement, backend: str):
        """(stream of (x0, labels) batches on the device, DataInfo) of the `data` section `d` (cfg.data, or
        a config.DataConfig), whose fields the kind reads itself, built `at` (seed, device, rank, split);
        `backend`: "memory" for a resident kind, else the file reader `data.backend` resolved to ("dali"
        or "torch")."""
        raise NotImplementedError

    def text_encoders(self, record: dict) -> str:
        """Captioned kinds: the folder of the text encoders whose identity `record` is (the recorded one)."""
        return record["path"]

    def reference(self, cfg, spec, ref_path: str | None, n: int) -> Reference:
        """The real data evaluations compare with: `ref_path` when given (a folder of images), else the
        kind's own (folder kinds: data.root when it still exists)."""
        return folder_reference(cfg, spec, ref_path or cfg.data.root, n)

    def reference_images(self, cfg, spec, ref_path: str | None, n: int):
        """`reference`'s FID images read as they go (data/reference.py `ReferenceImages`), for statistics
        of a reference too large to hold. The folder reference streams; a kind that overrides `reference`
        streams where it overrides this too, else its reference is loaded and handed out in chunks."""
        if type(self).reference is DataKind.reference:
            return folder_images(ref_path or cfg.data.root, spec, cfg.data, n)
        ref = self.reference(cfg, spec, ref_path, n)
        return ReferenceImages.held(ref.train, ref.source)


def data_kind(name: str) -> DataKind:
    """The registered kind `name` (a one-line InvalidInput for an unknown one)."""
    return DATA_KINDS.get(name)()


def traits(name: str) -> Traits:
    return data_kind(name).traits


def names() -> tuple[str, ...]:
    """Every value `data.name` can take."""
    return tuple(n for n in DATA_KINDS if DATA_KINDS.get(n).trainable)
