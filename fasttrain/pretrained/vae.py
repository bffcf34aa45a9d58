"""The VAE of latent diffusion: a diffusers `AutoencoderKL` from a local folder, what identifies it, and
the conventions that turn its latents into training data and back.

    vae = load_vae("sd-vae", device="cuda")      # or (pipeline_folder, subfolder="vae"); diffusers loads here
    mean, std = encode(vae, images)              # each image's posterior N(mean, std²) (images in [-1, 1])
    images = decode(vae, z)                      # raw latents → images in [-1, 1]

Latent normalisation (`data.latent_norm`): the network sees x = (z − shift_c)·scale_c per channel c,
and samples are decoded from z = x/scale_c + shift_c:

  vae      shift = the VAE's `shift_factor` (0 without one), scale = its `scaling_factor`: Stable
           Diffusion's single scale (Rombach et al. 2022, §4.3.2 / App. G: unit variance of the
           latents) and SD3's shift (Esser et al. 2024)
  channel  shift = the per-channel mean, scale = 1/the per-channel std of the sampled latents over the
           data set (`data prepare --vae` measures them), as EDM2 standardises its latents
           (Karras et al. 2024, `StabilityVAEEncoder`; EDM2 then scales by 0.5 for its σ_data)
  none     the latents as stored
  auto     vae where the folder records a VAE, else none (latents from a user's `--encoder`)

The record of a latent data set (`latent_record`) travels in the checkpoint's data spec, so that a
model bundle can decode its samples without the data: the VAE's identity (folder, config and weights
hashes, factors), the normalisation and the statistics. `LatentCodec` is that record with its VAE
loaded. diffusers is imported on first use only (optional.py).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from .. import optional
from ..errors import DataError, InvalidInput, MissingFile
from .model_folders import load_model, model_dir, read_config

NORMS = ("auto", "vae", "channel", "none")
WEIGHT_FILES = ("*.safetensors", "*.bin")  # hashed for the identity


# -- loading and identity --------------------------------------------------------------------------
def load_vae(folder: str | Path, subfolder: str | None = None, device="cpu"):
    """A diffusers AutoencoderKL from a local folder, in eval mode without gradients (a broken folder is
    one line naming the file: model_folders.py)."""
    path = model_dir(folder, subfolder)
    cls = read_config(path).get("_class_name")
    if cls not in (None, "AutoencoderKL"):
        raise InvalidInput(f"{path} holds a {cls}; latent encoding needs an AutoencoderKL (a posterior mean and std)")
    diffusers = optional.diffusers("a VAE")
    vae = load_model(diffusers.AutoencoderKL, folder, subfolder, what="VAE", low_cpu_mem_usage=False)
    return vae.eval().requires_grad_(False).to(device)


def config_sha256(config) -> str:
    """A hash of a diffusers config without its bookkeeping keys (_name_or_path, _diffusers_version)."""
    plain = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=list).encode()).hexdigest()


def weights_sha256(path: Path) -> str:
    """A hash of the weight files of a model folder (two fine-tunes of one VAE share their config)."""
    from . import file_hashes

    return file_hashes.sha256(sorted(p for pat in WEIGHT_FILES for p in path.glob(pat)), names=True)


def identity(vae, folder: str | Path, subfolder: str | None = None) -> dict:
    """What identifies a VAE: where it was, its class, its config and weights hashes and factors."""
    c = vae.config
    return {"path": str(Path(folder).resolve()), "subfolder": subfolder or None, "class": type(vae).__name__,
            "config_sha256": config_sha256(c), "weights_sha256": weights_sha256(model_dir(folder, subfolder)),
            "scaling_factor": float(c.scaling_factor), "shift_factor": None if c.get("shift_factor") is None
            else float(c.shift_factor), "latent_channels": int(c.latent_channels),
            "downsample": 2 ** (len(c.block_out_channels) - 1)}


# -- encoding and decoding -------------------------------------------------------------------------
@torch.no_grad()
def encode(vae, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior N(mean, std²) of images x in [-1, 1] (its log-variance clamped to [-30, 20] by
    diffusers' DiagonalGaussianDistribution)."""
    post = vae.encode(x.to(vae.device, vae.dtype)).latent_dist
    return post.mean.float(), post.std.float()


@torch.no_grad()
def decode(vae, z: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Raw latents → images in [-1, 1], `chunk` at a time (decoders are memory-hungry)."""
    out = [vae.decode(z[i:i + chunk].to(vae.device, vae.dtype)).sample.float().clamp(-1, 1)
           for i in range(0, len(z), chunk)]
    return torch.cat(out)


# -- the latent space's normalisation ----------------------------------------------------------------
def latent_record(info: dict | None, norm: str) -> dict | None:
    """The record of a latent data set the model is trained on (a DataSpec's `latents`): the
    normalisation `norm` as per-channel shift/scale, from the folder's manifest section `info`
    (written by `data prepare --vae`; None for a folder of plain latents). None: nothing to record."""
    if norm not in NORMS:
        raise InvalidInput(f"data.latent_norm must be one of {', '.join(NORMS)}, got {norm!r}")
    vae = (info or {}).get("vae")
    mode = ("vae" if vae else "none") if norm == "auto" else norm
    if info is None:
        if mode == "none":
            return None
        raise DataError(f"data.latent_norm={norm} needs latents encoded by `fasttrain data prepare --vae` "
                        f"(this folder records no VAE and no latent statistics)")
    C = int(info["channels"])
    if mode == "vae":
        if not vae:
            raise DataError("data.latent_norm=vae: the folder's latents record no VAE (use channel or none)")
        shift, scale = [vae["shift_factor"] or 0.0] * C, [vae["scaling_factor"]] * C
    elif mode == "channel":
        mean, std = info.get("channel_mean"), info.get("channel_std")
        if not mean or not std:
            raise DataError("data.latent_norm=channel: the folder's manifest holds no per-channel statistics")
        shift, scale = list(mean), [1.0 / max(s, 1e-12) for s in std]
    else:
        shift, scale = [0.0] * C, [1.0] * C
    return {"norm": mode, "shift": [float(v) for v in shift], "scale": [float(v) for v in scale],
            "posterior": info.get("posterior") == "mean_std", "channels": C, "vae": vae,
            "source": info.get("source"), "image_size": info.get("image_size"),
            "channel_mean": info.get("channel_mean"), "channel_std": info.get("channel_std")}


def _column(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(1, -1, *([1] * (like.ndim - 2)))


def normalize(z: torch.Tensor, record: dict) -> torch.Tensor:
    """Raw latents → what the network sees: (z − shift)·scale per channel."""
    return (z - _column(record["shift"], z)) * _column(record["scale"], z)


def denormalize(x: torch.Tensor, record: dict) -> torch.Tensor:
    """What the network generates → raw latents for the VAE: x/scale + shift per channel."""
    return x / _column(record["scale"], x) + _column(record["shift"], x)


class LatentCodec:
    """A latent record with its VAE loaded: decodes what the network generates into images.

    `folder` overrides the recorded VAE folder (`--vae`); a VAE whose hashes differ from the recorded
    ones decodes with a warning line (another fine-tune of the same VAE decodes, but not what the model
    learnt), one with another number of latent channels is refused."""

    def __init__(self, vae, record: dict):
        self.vae, self.record = vae, record

    @classmethod
    def load(cls, record: dict, folder: str | None = None, subfolder: str | None = None, device="cpu") -> LatentCodec:
        rec = record.get("vae")
        if not rec and not folder:
            raise InvalidInput("these latents were not encoded by a VAE that fasttrain knows: pass --vae FOLDER to "
                               "decode them")
        if folder is None:
            folder, subfolder = rec["path"], rec.get("subfolder")
            if not Path(folder).is_dir():
                raise MissingFile(f"the run's VAE folder {folder!r} is gone: pass --vae FOLDER")
        elif subfolder is None and not (Path(folder) / "config.json").is_file() \
                and (Path(folder) / "vae" / "config.json").is_file():
            subfolder = "vae"  # a pipeline folder given as --vae
        vae = load_vae(folder, subfolder, device)
        if vae.config.latent_channels != record["channels"]:
            raise InvalidInput(f"the VAE in {folder} has {vae.config.latent_channels} latent channels, the model "
                               f"generates {record['channels']}")
        if rec:
            now = identity(vae, folder, subfolder)
            diff = [k for k in ("config_sha256", "weights_sha256") if now[k] != rec.get(k)]
            if diff:
                print(f"fasttrain: warning: the VAE in {folder} is not the one the latents were encoded with "
                      f"({', '.join(d.split('_')[0] for d in diff)} differ); decoding anyway", file=sys.stderr)
        return cls(vae, record)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Generated (normalised) latents → images in [-1, 1], on the samples' device."""
        return decode(self.vae, denormalize(x.float(), self.record)).to(x.device)


class LatentDecoder:
    """A latent run's way from generated latents to images: the recorded VAE (or `folder`, `--vae`) loaded
    on first use as a `LatentCodec`. `decodes`: whether there is a VAE to decode with at all."""

    def __init__(self, record: dict | None, folder: str | None = None, device="cpu"):
        self.record, self.folder, self.device, self._codec = record, folder, device, None

    @property
    def decodes(self) -> bool:
        return bool(self.record and (self.record.get("vae") or self.folder))

    @property
    def codec(self) -> LatentCodec:
        if self._codec is None:
            if not self.record:
                raise InvalidInput("this model was not trained on latents: there is nothing to decode")
            self._codec = LatentCodec.load(self.record, self.folder, device=self.device)
        return self._codec

    def decode(self, x):
        """Generated latents → images in [-1, 1] (the normalisation undone, then the VAE's decoder)."""
        return self.codec.decode(x)
