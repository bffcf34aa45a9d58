"""Captions of an image folder, in the two conventions users already have:

  * a same-name `.txt` beside each image (sd-scripts, kohya): `cat.png` ↔ `cat.txt`; each non-empty line
    is one alternative caption, and one is drawn each time the image is read (conditioning.TextCaptions);
  * diffusers' ImageFolder `metadata.jsonl` at the folder's root: one JSON object per line with
    `file_name` (relative to the root) and a caption column (`data.caption_column`, default "text"; a
    string or a list of alternatives).

`metadata.jsonl` wins where it exists. An image without a caption (no file, an empty or blank file, no
row) is counted and the run refused, naming the count and the first one, unless `allow_empty` (then it
trains on the empty prompt). One line naming the file, for: a caption file that is not UTF-8; a
`metadata.jsonl` line that is not a JSON object with a `file_name`, a caption that is not text, no row
with the caption column (its columns are named), rows naming files that are not in the folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import DataError

METADATA = "metadata.jsonl"


def read_caption_file(path: Path) -> list[str]:
    """The non-empty lines of a caption file, stripped (no lines: no caption)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); save the caption as UTF-8") from None
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def _metadata(root: Path, column: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    file = root / METADATA
    try:
        lines = file.read_bytes().decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text (byte {e.start})") from None
    columns: set[str] = set()
    ghosts: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file} line {n}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise DataError(f"{file} line {n}: a row needs \"file_name\" (a path) and a \"{column}\" column")
        columns |= set(row)
        value = row.get(column)
        if value is not None and not (isinstance(value, str) or isinstance(value, list)
                                      and all(isinstance(c, str) for c in value)):
            raise DataError(f"{file} line {n}: column {column!r} must be a string or a list of strings")
        caps = [value] if isinstance(value, str) else list(value or [])
        name = str(Path(row["file_name"]))
        if not (root / name).is_file():
            ghosts.append((n, name))
        out[name] = [c.strip() for c in caps if c.strip()]
    if out and column not in columns:  # the wrong column, not missing captions
        others = ", ".join(sorted(columns - {"file_name"})) or "none besides file_name"
        raise DataError(f"{file}: no row has a {column!r} column (its columns: {others}): pass --caption-column "
                        f"NAME to `data prepare`")
    if ghosts:  # a row for an image that is not there: a renamed or deleted file, or rows of another folder
        n, name = ghosts[0]
        raise DataError(f"{file}: {len(ghosts)} row(s) name files that are not in {root} (e.g. {name!r}, line {n}): "
                        f"remove those rows or add the images")
    return out


def captions_for(root: str | Path, files: list[str], column: str = "text", allow_empty: bool = False,
                 say=None) -> list[list[str]]:
    """Each image's alternative captions (at least one: [""] for an allowed missing caption), for `files`
    (paths relative to `root`)."""
    root = Path(root)
    meta = _metadata(root, column) if (root / METADATA).is_file() else None
    caps, missing = [], []
    for rel in files:
        if meta is not None:
            c = meta.get(str(Path(rel)), [])
        else:
            txt = (root / rel).with_suffix(".txt")
            c = read_caption_file(txt) if txt.is_file() else []
        if not c:
            missing.append(rel)
        caps.append(c or [""])
    if missing:
        where = f"no row with a {column!r} caption in {METADATA}" if meta is not None else "no .txt caption beside it"
        line = f"{len(missing)} of {len(files)} images have {where} (e.g. {missing[0]})"
        if not allow_empty:
            raise DataError(f"{line}: add captions, or pass --allow-empty-captions to `data prepare` to train them "
                            f"on the empty prompt")
        (say or (lambda s: print(s, file=sys.stderr)))(f"fasttrain: {line}: trained on the empty prompt")
    return caps
