"""Frozen image encoders whose patch features a network is aligned to (REPA, diffusion/align.py), from a
local folder or the user's own code (never downloaded):

  FOLDER            a transformers model folder `AutoModel` reads (DINOv2 and alike): images in [-1, 1] are
                    mapped to [0, 1], normalised by the folder's preprocessor_config.json image_mean/std
                    (ImageNet's without one), grey images repeated to its channels, resized (bicubic) to
                    `size` (default: the processor's crop size, else the model config's image_size), as
                    REPA's train.py `preprocess_raw_image` does for DINOv2; the patch tokens of
                    `last_hidden_state` (the final layer norm applied) without the CLS and register tokens
                    (REPA: DINOv2's `x_norm_patchtokens`)
  module:function   a function returning an nn.Module that maps images [B, C, H, W] in [-1, 1] to patch
                    features [B, N, D] (a square grid of N) or a feature map [B, D, h, w]
                    (fasttrain.pretrained.digits_encoder:encoder, the digits one)

    enc = load("dinov2-small")                      # FrozenEncoder: eval, no gradients
    z = enc(x)                                      # [B, N, D]; enc.dim == D
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput, MissingFile

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
KEY = "diffusion.align.encoder"


def tokens_of(out: torch.Tensor) -> torch.Tensor:
    """[B, D, h, w] feature maps → [B, h·w, D] tokens; [B, N, D] as they are."""
    if out.ndim == 4:
        return out.flatten(2).transpose(1, 2)
    if out.ndim != 3:
        raise InvalidInput(f"{KEY}: the encoder returned a tensor of shape {tuple(out.shape)}; it must give patch "
                           f"features [B, N, D] or a feature map [B, D, h, w]")
    return out


class FrozenEncoder(nn.Module):
    """An encoder as the alignment reads it: images in [-1, 1] → [B, N, D] patch tokens, without gradients."""

    def __init__(self, net: nn.Module, source: str, hf: dict | None = None):
        super().__init__()
        self.net, self.source, self.hf = net.eval().requires_grad_(False), source, hf
        if hf is not None:
            self.register_buffer("mean", torch.tensor(hf["mean"]).view(1, -1, 1, 1), persistent=False)
            self.register_buffer("std", torch.tensor(hf["std"]).view(1, -1, 1, 1), persistent=False)
        self.dim: int | None = None

    def train(self, mode: bool = True):  # frozen: always in eval mode (dropout, batch norm statistics)
        return super().train(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hf is None:
            return tokens_of(self.net(x))
        h = self.hf
        if x.shape[1] != h["channels"]:
            if x.shape[1] != 1:
                raise InvalidInput(f"{KEY}: the encoder takes {h['channels']} channels, the images have {x.shape[1]}")
            x = x.expand(-1, h["channels"], -1, -1)
        x = ((x.float() + 1) / 2 - self.mean) / self.std
        if x.shape[-1] != h["size"] or x.shape[-2] != h["size"]:
            x = F.interpolate(x, size=(h["size"], h["size"]), mode="bicubic", align_corners=False)
        out = self.net(pixel_values=x.to(next(self.net.parameters()).dtype)).last_hidden_state
        return tokens_of(out[:, h["skip"]:] if out.ndim == 3 else out)


def _function(spec: str):
    mod, fn = spec.split(":", 1)
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and mod.startswith(e.name):  # the module itself is missing, not one it imports
            raise InvalidInput(f"{KEY}={spec}: no module named {e.name!r}") from None
        raise
    if not callable(getattr(module, fn, None)):
        raise InvalidInput(f"{KEY}={spec}: module {mod!r} has no function {fn!r}")
    net = getattr(module, fn)()
    if not isinstance(net, nn.Module):
        raise InvalidInput(f"{KEY}={spec}: {fn}() returned a {type(net).__name__}, not a torch.nn.Module")
    return net


def _folder(path: Path, size: int | None):
    from .text_encoders import transformers

    if not (path / "config.json").is_file():
        raise MissingFile(f"{KEY}={path}: no config.json there (a transformers model folder, or module:function)")
    tf = transformers()
    try:
        net = tf.AutoModel.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a broken folder's many error types: one line naming it
        raise InvalidInput(f"{KEY}={path}: transformers cannot load it ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})") from None
    cfg = net.config
    proc = path / "preprocessor_config.json"
    p = json.loads(proc.read_text()) if proc.is_file() else {}
    crop = p.get("crop_size")
    crop = crop.get("height") if isinstance(crop, dict) else crop
    side = size or crop or getattr(cfg, "image_size", None)
    if not side:
        raise InvalidInput(f"{KEY}={path}: its config names no image size: set diffusion.align.encoder_size")
    channels = int(getattr(cfg, "num_channels", 3))
    mean, std = p.get("image_mean", IMAGENET_MEAN), p.get("image_std", IMAGENET_STD)
    hf = {"size": int(side), "channels": channels, "mean": list(mean)[:channels], "std": list(std)[:channels],
          "skip": 1 + int(getattr(cfg, "num_register_tokens", 0) or 0)}  # CLS, then DINOv2's registers
    return net, hf


def load(spec: str, size: int | None = None, device="cpu") -> FrozenEncoder:
    """The encoder `spec` names (module docstring), frozen, on `device`."""
    path = Path(spec)
    if ":" in spec and not path.exists():
        enc = FrozenEncoder(_function(spec), spec)
    elif path.is_dir():
        net, hf = _folder(path, size)
        enc = FrozenEncoder(net, str(path.resolve()), hf)
    else:
        raise MissingFile(f"{KEY}={spec}: neither a model folder nor module:function")
    return enc.to(device)


def probe(enc: FrozenEncoder, channels: int, image_size: int) -> tuple[int, int]:
    """(tokens N, width D) of the encoder's output for images of this shape (one image, on its device)."""
    dev = next(enc.buffers(), None)
    dev = dev.device if dev is not None else next(enc.net.parameters()).device
    z = enc(torch.zeros(1, channels, image_size, image_size, device=dev))
    enc.dim = int(z.shape[-1])
    return int(z.shape[1]), int(z.shape[-1])
