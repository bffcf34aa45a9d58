"""Per-image loss masks (`data.mask`), sd-scripts' masked loss (`--masked_loss`, `--alpha_mask`): a weight in
[0, 1] per pixel that multiplies the per-pixel loss inside the loss op (kernels/diffusion_loss.py `mask`).

  alpha  the image's own alpha channel, alpha / 255, as sd-scripts' --alpha_mask reads it
         (library/train_util.py: load_image(path, alpha=True), img[:, :, 3] / 255). An image without an
         alpha channel trains everywhere (a mask of ones, as sd-scripts gives it); they are counted and
         said once.
  file   a grayscale NAME.mask.png beside NAME.EXT (white = train, black = ignore, value / 255; a colour
         file is converted to grey by Pillow's ITU-R 601-2 luma). sd-scripts keeps its masks in a
         separate conditioning folder under the same names and reads their R channel
         (custom_train_functions.apply_masked_loss); fasttrain keeps them beside the images. The file
         must have the image's size (after both EXIF orientations); files named NAME.mask.* are masks,
         never data (layout.py).

The mask goes through the image's own resize, crop and flip (folder.py, buckets.py: the same PIL
operations on the same boxes), so a flipped sample's mask is flipped. For latents it is then resized to
the latent grid as sd-scripts resizes it before the loss: F.interpolate(mask, size=(h, w), mode="area")
(apply_masked_loss), which for the VAE's 8× downsampling is the mean of each 8×8 block; `data prepare
--vae --mask MODE` stores that [1, h, w] float32 array as NAME.mask.npy beside NAME.npy (encode.py).

The loss is sd-scripts': mean over all elements of m·ρ(d), not Σ m·ρ(d) / Σ m (kernels/
torch_ref_diffusion_loss.py), so an image that is half masked out contributes half as much.

Bad masks: a missing or unreadable mask file or one of another size than its image is a one-line
error naming the file; an all-zero mask (the image adds nothing to the loss) and, for alpha, an image
without alpha are counted warnings (`scan`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from ..errors import DataError
from .images import MASK_SUFFIX, SIXTEEN_BIT

MODES = ("none", "alpha", "file")
LATENT_SUFFIX = ".mask.npy"  # a latent's mask beside NAME.npy (encode.py)


def mask_file(image: str | Path) -> Path:
    """NAME.mask.png beside NAME.EXT."""
    image = Path(image)
    return image.with_name(image.stem + MASK_SUFFIX)


def latent_mask_file(latent: str | Path) -> Path:
    """NAME.mask.npy beside NAME.npy."""
    latent = Path(latent)
    return latent.with_name(latent.stem + LATENT_SUFFIX)


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (im.mode in ("P", "L", "RGB") and "transparency" in im.info)


def open_mask(path: str | Path, mode: str) -> tuple[Image.Image, bool]:
    """(the mask of the image at `path` as a PIL image of mode 'L' (8-bit) or 'F' (16-bit, in [0, 1]), of the
    image's size after its EXIF orientation; whether it was there: alpha mode without alpha gives ones).
    DataError naming the file for a missing, unreadable or wrongly sized mask."""
    path = Path(path)
    try:
        with Image.open(path) as im:
            im.load()
            ImageOps.exif_transpose(im, in_place=True)
            size = im.size
            if mode == "alpha":
                if not _has_alpha(im):
                    return Image.new("L", size, 255), False
                rgba = im.convert("RGBA") if im.mode not in ("RGBA", "LA") else im
                return rgba.getchannel("A"), True
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"cannot decode {path} ({type(e).__name__}) for its mask (data.mask={mode})") from None
    mf = mask_file(path)
    if not mf.is_file():
        raise DataError(f"data.mask=file: {mf} is missing (the mask of {path.name}: a grayscale PNG of the image's "
                        f"size, white = train)")
    try:
        with Image.open(mf) as m:
            m.load()
            ImageOps.exif_transpose(m, in_place=True)
            if m.mode in SIXTEEN_BIT:
                m = Image.fromarray(np.asarray(m, dtype=np.float32) * np.float32(1 / 65535), "F")
            elif m.mode != "L":
                m = m.convert("L")
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"cannot decode the mask {mf} ({type(e).__name__}): write it as a grayscale PNG") from None
    if m.size != size:
        raise DataError(f"the mask {mf} is {m.size[0]}×{m.size[1]}, its image {path.name} is {size[0]}×{size[1]}: "
                        f"a mask has its image's size")
    return m, True


def to_tensor(m: Image.Image) -> torch.Tensor:
    """A mask image → float32 [1, H, W] in [0, 1]."""
    a = np.asarray(m, dtype=np.float32)
    if m.mode != "F":
        a = a / np.float32(255)
    return torch.from_numpy(np.ascontiguousarray(a))[None]


def to_grid(m: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Masks [B, 1, H, W] → [B, 1, h, w] on the latent grid, as sd-scripts' apply_masked_loss resizes them
    (F.interpolate, mode="area"); the same tensor where the sizes agree (pixel data)."""
    if tuple(m.shape[-2:]) == tuple(size):
        return m
    return F.interpolate(m.float(), size=tuple(size), mode="area")


def scan(root: str | Path, files: list, mode: str, progress: bool = False) -> dict:
    """Every image's mask read once (errors as open_mask): {"no_alpha": [...], "all_zero": [...]} of relative
    paths, for `say_counts`."""
    from tqdm.auto import tqdm

    out: dict[str, list[str]] = {"no_alpha": [], "all_zero": []}
    for rel, _ in tqdm(files, desc="checking masks", unit="image", disable=not progress or len(files) < 200):
        m, present = open_mask(Path(root) / rel, mode)
        if not present:
            out["no_alpha"].append(str(rel))
        elif m.getextrema()[1] == 0:
            out["all_zero"].append(str(rel))
    return out


def say_counts(report: dict, mode: str, say) -> None:
    """The counted warnings of a scan, one line each."""
    for key, what in (("no_alpha", "have no alpha channel: trained everywhere (a mask of ones, as sd-scripts)"),
                      ("all_zero", "have an all-zero mask: they add nothing to the loss")):
        names = report.get(key) or []
        if names:
            shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            say(f"fasttrain: warning: data.mask={mode}: {len(names)} image(s) {what} ({shown})")
