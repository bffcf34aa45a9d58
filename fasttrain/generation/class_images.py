"""Class images for DreamBooth prior preservation (`fasttrain data class-images`, data/prior.py), made by the
base model itself, as diffusers' train_dreambooth*.py makes them when `--class_data_dir` holds fewer than
`--num_class_images`: the pipeline folder's text encoders, its denoiser and its VAE, sampled with fasttrain's
own sampler (a `ModelBundle` built from the pretrained folder: generation/sampling.py), so that class image
i is `seed + i`'s (EDM2's rule; a stock pipeline given `torch.Generator().manual_seed(seed + i)` makes the
same image: tests/text_runs.py `same_samples`).

The folder may already hold the user's own class images (any image not named class-NNNNN.png): they count
towards `num`, as in diffusers, and class images 0 … num − own − 1 are made. Each is written whole
(a temporary file, then a rename) with its caption beside it (class-NNNNN.txt, the class prompt: `data
prepare CLASS_DIR --vae PIPE --text-encoders PIPE` reads it), so an interrupted run continues where it
stopped and gives the images an uninterrupted one would; the settings are recorded in class-images.json
and a rerun with other settings into the same folder is refused (one line).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, InvalidInput

RECORD = "class-images.json"
NAME = re.compile(r"class-(\d{5,})\.png$")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def backbone_of(pipe: Path) -> tuple[str, str]:
    """(the denoiser's subfolder, its diffusers class) of a pipeline folder."""
    for sub in ("unet", "transformer"):
        cfg = pipe / sub / "config.json"
        if cfg.is_file():
            try:
                return sub, json.loads(cfg.read_text())["_class_name"]
            except (ValueError, KeyError):
                raise DataError(f"{cfg} is not a diffusers model config") from None
    raise InvalidInput(f"{pipe} holds no unet/ or transformer/ folder: class images are made by a pipeline folder's "
                       f"denoiser")


def base_bundle(pipe: str | Path, image_size: int, device, overrides: list[str] = ()):
    """A `ModelBundle` of the untrained base: the pipeline's denoiser (its scheduler adopted as a fine-tune
    adopts it), its VAE and text encoders recorded as a captioned latent run's would be."""
    from ..bundle import ModelBundle
    from ..configure import load_config
    from ..data.captioned import record_of
    from ..data.spec import DataSpec
    from ..pretrained.text_encoders import TextEncoders
    from ..pretrained.vae import identity, latent_record, load_vae

    pipe = Path(pipe)
    sub, cls = backbone_of(pipe)
    vae = identity(load_vae(pipe, "vae"), pipe, "vae")
    if image_size % vae["downsample"]:
        raise InvalidInput(f"--image-size {image_size} is not a multiple of the VAE's downsampling "
                           f"({vae['downsample']})")
    enc = TextEncoders.load(str(pipe), None, device)
    e = enc.encode([""])
    text = record_of(enc.identity(), e, enc.family == "sdxl", [])
    cfg = load_config("default", ["model.name=diffusers", f"model.args.class_name={cls}",
                                  f"model.args.pretrained={pipe}", f"model.args.subfolder={sub}",
                                  "data.name=captioned_latents", f"data.root={pipe}", "data.latent_norm=vae",
                                  "train.progress=false", *overrides])
    latents = latent_record({"channels": vae["latent_channels"], "vae": vae, "posterior": "mean_std",
                             "image_size": image_size}, "vae")
    spec = DataSpec("captioned_latents", vae["latent_channels"], image_size // vae["downsample"], 0, 0.0, latents,
                    None, text)
    return ModelBundle.build(cfg, spec, device)


def own_images(out: Path) -> list[Path]:
    """The images in `out` that this command did not make (they count towards --num-images)."""
    return sorted(p for p in out.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not NAME.match(p.name))


def _claim(out: Path, record: dict) -> None:
    file = out / RECORD
    if file.is_file():
        old = json.loads(file.read_text())
        diff = sorted(k for k in record if old.get(k) != record[k])
        if diff:
            raise InvalidInput(f"--out {out} holds class images made with other settings ({', '.join(diff)}: "
                               f"{old.get(diff[0])!r}, now {record[diff[0]]!r}): use another folder or the same "
                               f"settings")
    else:
        file.write_text(json.dumps(record, indent=1))


def generate(pipe: str | Path, prompt: str, num: int, out: str | Path, *, seed: int = 0, steps: int = 25,
             guidance: float = 7.5, negative_prompt: str = "", image_size: int = 512, batch_size: int = 4,
             solver: str | None = None, spacing: str | None = None, device=None, progress: bool = False) -> dict:
    """Make the class images `out` lacks (module docstring); returns {"own", "made", "kept", "total"}."""
    from PIL import Image
    from tqdm.auto import tqdm

    from .ranks import to_uint8

    if not prompt.strip():
        raise InvalidInput("--prompt is empty: give the class prompt (e.g. \"a photo of a dog\")")
    if num < 1:
        raise InvalidInput(f"--num-images must be at least 1, got {num}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    own = own_images(out)
    need = max(0, num - len(own))
    todo = [i for i in range(need) if not (out / f"class-{i:05d}.png").is_file()]
    result = {"own": len(own), "made": len(todo), "kept": need - len(todo), "total": len(own) + need}
    if not todo:
        return result
    record = {"pipeline": str(Path(pipe).resolve()), "prompt": prompt, "negative_prompt": negative_prompt,
              "seed": seed, "steps": steps, "guidance": guidance, "image_size": image_size, "solver": solver,
              "spacing": spacing}  # None: the pipeline's
    _claim(out, record)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    b = base_bundle(pipe, image_size, device)
    if b.cfg.diffusion.prediction == "flow":  # SD3 and Flux pipelines: FlowMatchEulerDiscreteScheduler's steps
        solver, spacing = solver or "flow_euler", spacing or "trailing"
    solver, spacing = solver or b.cfg.sample.solver, spacing or b.cfg.sample.spacing
    runs, start = [], None  # consecutive missing indices, in chunks of batch_size
    for k, i in enumerate(todo):
        if start is None or i != todo[k - 1] + 1 or i - start >= batch_size:
            runs.append([i, 1])
            start = i
        else:
            runs[-1][1] += 1
    bar = tqdm(total=len(todo), desc="class images", unit="image", disable=not progress)
    for first, n in runs:
        x = b.generate(n, prompts=[prompt], seed=seed, first_image=first, steps=steps, solver=solver,
                       guidance=guidance, negative_prompt=negative_prompt, spacing=spacing)
        for j, img in enumerate(to_uint8(b.decode(x)).numpy()):
            name = out / f"class-{first + j:05d}"
            name.with_suffix(".txt").write_text(prompt + "\n")
            tmp = out / f".{name.name}.{os.getpid()}.tmp.png"
            Image.fromarray(np.ascontiguousarray(img)).save(tmp)
            os.replace(tmp, name.with_suffix(".png"))  # whole or absent: a rerun makes it again
        bar.update(n)
    bar.close()
    return result
