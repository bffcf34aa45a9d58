"""Batches of VAE latents as the network sees them: a draw from each image's stored posterior, then the
normalisation the run names (`data.latent_norm`, vae.py), on the device, before anything else reads the
batch (the objective, the look-ahead probes, the interference diagnostic).

Folders written by `data prepare --vae` hold [mean; std] per image (data/encode.py): each time a file
is read, z = mean + std·ε with a fresh ε (the posterior sampling of latent diffusion, Rombach et al.
2022, whose data are z ~ q(z|x), as EDM2 and fast-DiT do with stored moments). ε is drawn from a
generator seeded by (train.seed, rank, the stream's position before the batch), so the draws are
reproducible and a resumed run continues with the same ones; they cost no host sync.
"""
from __future__ import annotations

import torch

from .. import seeds
from ..pretrained.vae import normalize


def prepare_batch(x: torch.Tensor, record: dict, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stored latents [B, C or 2C, h, w] → normalised latents [B, C, h, w]: a posterior draw (its mean
    without a generator) where the record says that mean and std are stored."""
    if record["posterior"]:
        mean, std = x.float().chunk(2, dim=1)
        x = mean if generator is None else mean + std * torch.randn(mean.shape, generator=generator,
                                                                    device=mean.device, dtype=mean.dtype)
    return normalize(x.float(), record)


class LatentStream:
    """A data stream (memory, DataLoader or DALI) whose latent batches go through `prepare_batch`; its
    position (state_dict) is the wrapped stream's."""

    def __init__(self, inner, record: dict, seed: int, rank: int = 0):
        self.inner, self.record, self.seed, self.rank = inner, record, seed, rank

    def __iter__(self):
        return self

    def __next__(self):
        where = (self.inner.epoch, self.inner.pos)  # before the batch: the same on a resumed run
        x, y, *mask = next(self.inner)  # a loss mask rides along as it is (folder.py)
        g = None
        if self.record["posterior"]:
            g = torch.Generator(x.device).manual_seed(seeds.derive(self.seed, "posterior", self.rank, *where))
        return prepare_batch(x, self.record, g), y, *mask

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
