"""Which files a data folder holds and their labels, decided by explicit rules that refuse what they
cannot decide (one line naming the path), and say what they decided (`Layout.describe`):

1. Names starting with "." are not data (hidden files and folders, a write's temporary files).
2. Flat: files only at the top level → unlabelled (label 0). Class subfolders: files only in
   subfolders → one class per subfolder, sorted by name (torchvision's ImageFolder layout); a class
   holds the files anywhere below its folder.
3. Both top-level files and subfolders that hold files: refused (either the loose files or the
   subfolders would be dropped, or a stray folder would become the only class).
4. Subfolders holding no files of the kind: in the class layout an empty class is refused (it would
   shift every label after it); beside a flat folder's files they are left out and named.
5. Symbolic links: a link to a file inside the folder is read; a link that leaves the folder (to a
   file or a folder), or a linked folder inside it (it loops back to a folder above it, or repeats
   files the walk reads anyway), is refused.
6. Files named NAME.mask.EXT are loss masks (data.mask, masks.py: an image's NAME.mask.png, a latent's
   NAME.mask.npy), never data.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .images import IMAGE_EXTENSIONS, is_mask

LATENT_EXTENSIONS = (".npy",)


@dataclass
class Layout:
    root: Path
    files: list[tuple[str, int]]
    classes: list[str]
    ignored: list[str] = field(default_factory=list)  # subfolders without files of the kind (flat layout)

    def describe(self) -> str:
        """One line: what the rules decided."""
        if self.classes:
            counts = Counter(y for _, y in self.files)
            shown = ", ".join(f"{c} {counts[i]}" for i, c in enumerate(self.classes[:6]))
            more = f", ... ({len(self.classes) - 6} more)" if len(self.classes) > 6 else ""
            return (f"{self.root}: {len(self.classes)} classes from its subfolders ({shown}{more}), "
                    f"{len(self.files)} files")
        skipped = (f"; {len(self.ignored)} subfolder(s) without such files left out ({', '.join(self.ignored[:3])}"
                   f"{' ...' if len(self.ignored) > 3 else ''})") if self.ignored else ""
        return f"{self.root}: unlabelled (no class subfolders), {len(self.files)} files at its top level{skipped}"


def _link_problem(root: Path, link: Path) -> str | None:
    """Why rule 5 refuses this link (None: a file link that stays inside the folder)."""
    real_root, target = root.resolve(), link.resolve()
    inside = target == real_root or target.is_relative_to(real_root)
    if not link.is_dir():
        return None if inside else f"leaves the folder (→ {target})"
    if not inside:
        return f"leaves the folder (→ {target})"
    if link.parent.resolve().is_relative_to(target):
        return f"loops back to {target}"
    return f"repeats {target} (its files would be read twice)"


def walk(root: str | Path) -> dict[str, list[Path]]:
    """Every data file under `root` by rules 1 and 5, grouped by top-level entry: "" for the top
    level's files, else a subfolder's name → the files below it (empty for a folder without files)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root {str(root)!r} is not a directory")
    found: dict[str, list[Path]] = {"": []}
    stack = [(root, "")]
    while stack:
        here, top = stack.pop()
        with os.scandir(here) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        for e in entries:
            p = Path(e.path)
            if e.is_symlink():  # from the directory entry: no extra system call per file
                why = _link_problem(root, p)
                if why:
                    raise DataError(f"{root}: the symbolic link {p.relative_to(root)} {why}; replace it by what it "
                                    f"points to, or remove it")
            if e.is_dir(follow_symlinks=False):
                key = top or e.name
                found.setdefault(key, [])
                stack.append((p, key))
            else:
                found[top].append(p)
    return found


def decide(root: str | Path, extensions=IMAGE_EXTENSIONS) -> Layout:
    """The files with `extensions` under `root` and their labels, by the rules above."""
    root = Path(root)
    kind = "/".join(extensions)
    found = {k: sorted(f for f in v if f.suffix.lower() in extensions and not is_mask(f))
             for k, v in walk(root).items()}
    top, subdirs = found.pop(""), found
    with_files = [d for d, fs in subdirs.items() if fs]
    if top and with_files:
        shown = ", ".join(f"{d}/ {len(subdirs[d])}" for d in with_files[:3]) + (" ..." if len(with_files) > 3 else "")
        raise DataError(f"{root} holds {len(top)} {kind} file(s) at its top level (e.g. {top[0].name}) and "
                        f"{len(with_files)} subfolder(s) of them ({shown}): a data folder is either flat (unlabelled) "
                        f"or class subfolders, so move the loose files into a class folder or the subfolders' up")
    if with_files:
        empty = [d for d, fs in subdirs.items() if not fs]
        if empty:
            raise DataError(f"data.root {str(root)!r}: class folder {empty[0]!r} holds no {kind} files (remove it, "
                            f"or it would count as a class)")
        classes = sorted(subdirs)
        files = [(str(f.relative_to(root)), i) for i, c in enumerate(classes) for f in subdirs[c]]
        return Layout(root, files, classes)
    if not top:
        raise DataError(f"data.root {str(root)!r} holds no {kind} files")
    return Layout(root, [(f.name, 0) for f in top], [], sorted(subdirs))


def scan(root: str | Path, extensions=IMAGE_EXTENSIONS) -> tuple[list[tuple[str, int]], list[str]]:
    """(files with their labels, class names) of `decide`."""
    layout = decide(root, extensions)
    return layout.files, layout.classes


def folder_kind(root: Path) -> str:
    """"images" or "latents", by what the folder holds; a folder with both is refused (one line): its
    kind would otherwise be a guess that silently drops the other files."""
    files = [f for fs in walk(root).values() for f in fs if not is_mask(f)]
    images = [f for f in files if f.suffix.lower() in IMAGE_EXTENSIONS]
    arrays = [f for f in files if f.suffix.lower() in LATENT_EXTENSIONS]
    if images and arrays:
        raise DataError(f"{root} holds both images ({len(images)}, e.g. {images[0].relative_to(root)}) and .npy "
                        f"arrays ({len(arrays)}, e.g. {arrays[0].relative_to(root)}): a data folder holds one kind, "
                        f"move the others")
    return "latents" if arrays else "images"
