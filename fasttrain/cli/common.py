"""What the commands share (commands.py, generate.py): the errors printed as one line, output paths checked
before anything is written, the folders a command on a checkpoint reads, and the checkpoint's bundle."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidInput, UserError

# What the user can fix is a UserError (errors.py), printed as one line; anything else keeps its
# traceback (FASTTRAIN_DEBUG=1 keeps it for these too). Paths the user named that cannot be written
# are theirs to fix as well.
USER_ERRORS = (UserError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)


def out_dir(path: str, create: bool = True) -> Path:
    """An output folder that can be created (and is, unless `create` is false): not a file, not under a file."""
    p = Path(path)
    for q in [p, *p.parents]:
        if q.exists() and not q.is_dir():
            raise InvalidInput(f"--out {path}: {q} is a file, not a folder")
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def out_file(path: str | Path, flag: str = "--out", create: bool = True) -> Path:
    """An output file whose folder can be created (and is, unless `create` is false)."""
    p = Path(path)
    if p.is_dir():
        raise InvalidInput(f"{flag} {path} is a folder; give a file name")
    out_dir(str(p.parent), create) if str(p.parent) not in ("", ".") else None
    return p


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def checkpoint_reads(args, b) -> dict:
    """The folders a command on a checkpoint reads or names as its own (paths.py: outputs stay out of them)."""
    from ..checkpoint import resolve

    lat = b.spec.latents or {}
    return {"the checkpoint": str(resolve(args.ckpt if hasattr(args, "ckpt") else args.run)),
            "the run's data folder": b.cfg.data.root, "the images its latents were encoded from": lat.get("source"),
            "the VAE folder": getattr(args, "vae", None) or (lat.get("vae") or {}).get("path")}


def load_bundle(args):
    """The checkpoint's model bundle; a latent run's VAE (the recorded one, or --vae) loaded now, so that
    a missing one is a one-line error before any sampling."""
    from ..bundle import ModelBundle

    b = ModelBundle.load(args.ckpt, vae=args.vae)
    folder = getattr(args, "text_encoders", None)
    if b.prompts is not None and folder:
        b.prompts.folder = folder
        b.prompts.encoders  # noqa: B018 - loads the text encoders and checks them against the recorded ones
    if args.vae and not b.spec.latents:
        raise InvalidInput(f"--vae: {args.ckpt} was not trained on VAE latents")
    if b.decodes:
        b.decoder.codec  # noqa: B018 - loads the VAE
    return b


def is_evaluation(path: Path) -> bool:
    """Whether `path` holds an evaluation's JSON (`fasttrain eval --out`), which a later one may replace."""
    try:
        return "step" in json.loads(path.read_text())
    except (ValueError, TypeError, UnicodeDecodeError):
        return False
