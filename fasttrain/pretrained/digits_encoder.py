"""The digits' representation encoder for alignment (REPA, diffusion/align.py): a small convolutional
network trained by the project with a self-supervised objective (SimCLR's contrastive NT-Xent loss, Chen et
al. 2020, between two augmented views) on a split that no evaluator and no diffusion run sees.

It must not be the evaluator. The FID/classifier extractor (`fasttrain-digits`, generation/features.py) is
an MLP trained with labels on the training split (the 1397 images a digits run trains on); this encoder is
trained without labels on the first 200 of the 400 held-out images, and the second evaluator
(`fasttrain-digits-cnn`, generation/digits_cnn.py) on the other 200, with labels. bench/digits_assets.py
trains both, deterministically, in seconds on one CPU thread, and writes fasttrain/assets/digits_ssl.pt
(this one) and digits_cnn.pt.

    diffusion.align.encoder=fasttrain.pretrained.digits_encoder:encoder          # the trained encoder
    diffusion.align.encoder=fasttrain.pretrained.digits_encoder:random_encoder   # the same network, random
                                                                                 # weights: alignment's control
Output: 16 patch tokens (a 4×4 grid over the 8×8 image) of 64 layer-normalised features, as DINOv2's
normalised patch tokens are.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ASSET = Path(__file__).parent.parent / "assets" / "digits_ssl.pt"
SPLIT = (0, 200)  # rows of the digits' held-out split (data/builtin.py `digits(split="test")`)


class DigitsEncoder(nn.Module):
    """[N, C, H, W] images in [-1, 1] (grey 8×8 after `prepare`) → [N, 16, 64] patch tokens."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(32, width, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Conv2d(width, width, 3, padding=1))
        self.norm = nn.LayerNorm(width)

    @staticmethod
    def prepare(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[1] == 3:
            x = x.mean(1, keepdim=True)
        if x.shape[-1] != 8:
            x = F.interpolate(x, size=(8, 8), mode="area")
        return x.clamp(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.prepare(x))
        return self.norm(h.flatten(2).transpose(1, 2))


def encoder() -> DigitsEncoder:
    """The trained encoder (fasttrain/assets/digits_ssl.pt)."""
    net = DigitsEncoder()
    net.load_state_dict(torch.load(ASSET, map_location="cpu", weights_only=True))
    return net.eval()


def random_encoder(seed: int = 0) -> DigitsEncoder:
    """The same architecture with seeded random weights: what alignment gives without a learned
    representation (the one-knob control of the alignment arm)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DigitsEncoder().eval()
