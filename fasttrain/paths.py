"""Outputs that would land among a command's own inputs, refused before anything is written.

A command that writes into a folder it reads corrupts its inputs: latents encoded into the image
folder they come from (the folder then holds both kinds and trains on neither), samples written into
a training folder (they would be trained on), a run directory inside its data (checkpoints and
figures among the images) or holding it (`--restart` moves everything in the run directory aside,
the data included), an evaluation result written over a checkpoint. The rules, by direction:

  an output folder that IS an input folder, or lies INSIDE one: refused (its files join the input);
  an output folder that HOLDS an input folder: refused where the command's own rules would touch it
  (a run directory, a latent folder), allowed otherwise (samples written beside a data folder);
  an output file: refused inside an input folder, or over an existing file that is not an earlier
  result of the same command.
"""
from __future__ import annotations

from pathlib import Path

from .errors import InvalidInput


def _real(p) -> Path:
    return Path(p).expanduser().resolve()


def relation(out, other) -> str | None:
    """"is", "inside" or "holds" for how `out` stands to `other` (resolved, links followed), else None."""
    a, b = _real(out), _real(other)
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "inside"
    if b.is_relative_to(a):
        return "holds"
    return None


def check_output(out, what: str, inputs: dict[str, str | None], holds_ok: bool = True, exact: bool = False) -> None:
    """Refuse an output folder `out` (described by `what`, e.g. "--out") that is, lies inside, or (unless
    `holds_ok`) holds one of `inputs` (description → path; None entries are skipped). `exact`: only an
    output that is the input itself is refused (a run directory: its subfolders are free)."""
    for name, path in inputs.items():
        if not path:
            continue
        rel = relation(out, path)
        if rel is None or (rel == "holds" and holds_ok) or (exact and rel != "is"):
            continue
        how = {"is": "is", "inside": "lies inside", "holds": "holds"}[rel]
        raise InvalidInput(f"{what} {out} {how} {name} {path}: a command never writes among what it reads; "
                           f"choose a folder outside it")


def check_output_file(out, what: str, inputs: dict[str, str | None], earlier_result=None) -> None:
    """Refuse an output file inside one of the input folders, or over an existing file that
    `earlier_result(path)` does not recognise as this command's own earlier output."""
    for name, path in inputs.items():
        rel = relation(out, path) if path else None
        if rel in ("is", "inside"):
            raise InvalidInput(f"{what} {out} {'is' if rel == 'is' else 'lies inside'} {name} {path}: choose a "
                               f"file outside it")
    p = Path(out)
    if p.is_file() and not (earlier_result is not None and earlier_result(p)):
        raise InvalidInput(f"{what} {out} exists and is not an earlier result of this command (it would be "
                           f"overwritten): choose a new file name")


def writable_folder(path, what: str) -> None:
    """Refuse (one line) to write under `path` where its nearest existing folder is read-only: the file
    system says so (os.access), or the folder's mode has no write bit (which root would write through)."""
    import os
    import stat

    from .errors import WriteError

    p = _real(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    if p.is_dir() and (not os.access(p, os.W_OK) or not p.stat().st_mode & bits):
        raise WriteError(f"{what} {path}: {p} is read-only (nothing was written); make it writable or choose "
                         f"another folder")
