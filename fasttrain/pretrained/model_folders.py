"""diffusers model folders on disk (a VAE, a pretrained backbone, a pipeline's subfolder): finding them,
reading their config.json and loading their weights. This is the one place where the third-party
failures of a broken folder (diffusers' OSError, json's JSONDecodeError, safetensors' and torch's
errors on a truncated file) become one line naming the file (errors.py); the callers (vae.py,
models/diffusers_backbone.py) never see them.

    path = model_dir("sd-vae", subfolder=None, what="VAE")       # the folder holding config.json
    config = read_config(path)                                   # its config.json as a dict
    vae = load_model(diffusers.AutoencoderKL, "sd-vae", None, what="VAE")
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError, MissingFile

# what ModelMixin.from_pretrained reads, in its order of preference (diffusers' SAFETENSORS_WEIGHTS_NAME,
# WEIGHTS_NAME and their sharded indexes)
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json")
# transformers' (a pipeline's text encoders: SAFE_WEIGHTS_NAME, WEIGHTS_NAME and their indexes)
TRANSFORMERS_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                             "pytorch_model.bin.index.json")


def model_dir(folder: str | Path, subfolder: str | None = None, what: str = "VAE", key: str = "--vae-subfolder ",
              child: str = "vae") -> Path:
    """The folder holding a diffusers model's config.json, or a one-line MissingFile naming it (with
    `key` as the hint when `folder` is a pipeline whose `child` subfolder holds the model)."""
    root = Path(folder)
    if not root.is_dir():
        raise MissingFile(f"{what} folder {str(folder)!r} does not exist")
    path = root / subfolder if subfolder else root
    if not (path / "config.json").is_file():
        pipeline = not subfolder and ((root / child / "config.json").is_file() or (root / "model_index.json").is_file())
        hint = f" (a pipeline folder: set {key}{child})" if pipeline else ""
        raise MissingFile(f"{what} folder {str(path)!r} holds no diffusers model (no config.json){hint}")
    return path


def read_config(path: Path, name: str = "config.json") -> dict:
    """A folder's JSON config as a dict; a cut-off, empty or edited file is one line naming it."""
    file = Path(path) / name
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise MissingFile(f"{file} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{file} cannot be read ({type(e).__name__})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        what = "is empty" if not text.strip() else f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        raise DataError(f"{file} {what}: the folder is damaged (copy it again)") from None
    if not isinstance(config, dict):
        raise DataError(f"{file} holds a JSON {type(config).__name__}, not a diffusers config (an object)")
    return config


def weights_file(path: Path, names: tuple[str, ...] = WEIGHT_FILES) -> Path:
    """The weights file diffusers (or, with `names`, transformers) will read from a model folder;
    missing or empty is one line."""
    found = [path / f for f in names if (path / f).is_file()]
    if not found:
        raise MissingFile(f"{path} holds no weights file ({names[0]} or {names[2]}): the folder is incomplete")
    if found[0].stat().st_size == 0:
        raise DataError(f"{found[0]} is empty: the folder is damaged (copy it again)")
    return found[0]


def load_model(cls, folder: str | Path, subfolder: str | None = None, what: str = "model",
               weight_files: tuple[str, ...] = WEIGHT_FILES, **kwargs):
    """`cls.from_pretrained` of a local folder (no download; diffusers' or, with `weight_files`,
    transformers' classes); a broken folder is one line naming the file. The config is read first so
    that its errors name config.json, not the weights."""
    path = model_dir(folder, subfolder, what)
    read_config(path)
    weights = weights_file(path, weight_files)
    try:
        return cls.from_pretrained(str(Path(folder)), subfolder=subfolder or None, local_files_only=True, **kwargs)
    except _load_errors() as e:  # a truncated or damaged file, a file of other sizes
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        first = first.split(" for '")[0][:160]  # diffusers repeats the path
        raise DataError(f"{what} in {path}: {weights.name} cannot be loaded by {cls.__name__}.from_pretrained "
                        f"({first}); the file is truncated or damaged (copy the folder again)") from None


def _load_errors() -> tuple[type[BaseException], ...]:
    """What from_pretrained raises for a damaged folder: diffusers wraps most in OSError/ValueError;
    torch.load and safetensors raise their own."""
    from safetensors import SafetensorError

    return OSError, ValueError, RuntimeError, EOFError, SafetensorError
