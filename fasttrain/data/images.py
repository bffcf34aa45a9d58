"""One image file as training reads it: Pillow decodes it at its stored bit depth, its EXIF orientation
is applied, and its mode is mapped to grey or RGB by fixed rules (the same values DALI's decoder
gives, tests/test_reliability.py compares them):

  8-bit modes      L, RGB as stored; 1 (bilevel), P (palette, with or without transparency), LA, RGBA,
                   CMYK, YCbCr, LAB, HSV converted by Pillow. Alpha is dropped: the colour stored under
                   it is kept, as torchvision's ImageFolder, diffusers' training scripts and DALI do.
  16-bit grey      I;16 (and the I mode older Pillows give 16-bit PNGs; of the formats read here only
                   they give integer modes): scaled by 1/65535 into a float image (mode F) that keeps
                   all 16 bits; converted to 8-bit grey it would clip (25%, 50% and 75% grey all read
                   as white).
  16-bit colour    Pillow decodes 16-bit RGB(A) PNGs to 8 bits per channel (the high byte): the scale
                   is right, the precision is 8 bits, as DALI's decoder gives them too.

Orientation: EXIF tag 274 is applied (ImageOps.exif_transpose), so a portrait photo stored sideways
trains upright, as DALI's decoder (`adjust_orientation`, on by default) reads it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SIXTEEN_BIT = ("I", "I;16", "I;16L", "I;16B", "I;16N")
MASK_SUFFIX = ".mask.png"  # NAME.mask.png: the loss mask of NAME.EXT (data.mask=file, masks.py), not an image


def is_mask(path: str | Path) -> bool:
    """NAME.mask.EXT: a loss mask (an image's NAME.mask.png, a latent's NAME.mask.npy; masks.py), never data."""
    return Path(path).stem.lower().endswith(".mask")


def decode(im: Image.Image, channels: int) -> Image.Image:
    """An opened image → mode 'L' or 'RGB' (8-bit), or 'F' in [0, 1] for 16-bit grey (module docstring).
    `channels` 1 or 3; a 16-bit grey image stays one band (the caller repeats it for RGB)."""
    im.load()
    ImageOps.exif_transpose(im, in_place=True)
    if im.mode in SIXTEEN_BIT:
        return Image.fromarray(np.asarray(im, dtype=np.float32) * np.float32(1 / 65535), "F")
    want = "L" if channels == 1 else "RGB"
    if im.mode == want:
        return im
    if im.mode in ("P", "PA") and "transparency" in im.info:  # via RGBA: Pillow's documented route for tRNS
        im = im.convert("RGBA")
    return im.convert(want)


def open_image(path: str | Path, channels: int) -> Image.Image:
    """Read and decode one file (see `decode`); Pillow's errors for corrupt files pass through."""
    with Image.open(path) as im:
        return decode(im, channels)


def describe(path: str | Path) -> tuple[tuple[int, int], str]:
    """Fully decode a file as training will: ((width, height) after its EXIF orientation, the stored
    mode). Raises what decoding raises."""
    with Image.open(path) as im:
        mode = im.mode
        out = decode(im, 3)
        return out.size, mode
