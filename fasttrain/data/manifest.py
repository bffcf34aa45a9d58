"""Data-set manifests: which files a folder holds, their labels, and which files are unreadable.

`fasttrain data prepare ROOT` decides the folder's layout (layout.py: classes or unlabelled, said in
one line), checks every file once (an image is fully decoded as training decodes it, images.py; a
latent is read whole), lists the unreadable ones instead of letting a loader crash on them mid-epoch,
and writes ROOT/fasttrain-manifest.json with the counts, classes, image sizes and modes. A latent
folder trains on one shape and dtype: the one most of its readable files have (more than half); the
others are listed with theirs and left out, and a folder where no layout holds most files is refused.
Loaders read their file list from the manifest; without one they scan the folder (and, for DALI,
check the images first, since a corrupt JPEG stops its pipeline). Optionally the images are encoded
to .npy latents by a user-supplied encoder.
"""
from __future__ import annotations

import collections
import importlib
import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..errors import DataError, InvalidInput
from ..paths import check_output, check_output_file
from .folder import ImageFolderDataset
from .images import IMAGE_EXTENSIONS, describe
from .layout import LATENT_EXTENSIONS, decide, folder_kind, scan

__all__ = ["IMAGE_EXTENSIONS", "LATENT_EXTENSIONS", "MANIFEST", "build_manifest", "check_image", "check_latent",
           "folder_kind", "left_out", "load_manifest", "prepare", "scan", "summary"]

MANIFEST = "fasttrain-manifest.json"


def check_image(path: Path) -> tuple[bool, str, tuple[int, int] | None, str | None]:
    """Fully decode an image as training does; (ok, reason, (width, height) upright, stored mode)."""
    try:
        size, mode = describe(path)
        return True, "", size, mode
    except Exception as e:  # PIL raises many types for truncated or corrupt files
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None, None


def check_latent(path: Path) -> tuple[bool, str, tuple | None, str | None]:
    """Read a .npy latent fully; (ok, reason, shape, dtype as numpy's str, e.g. '<f4'). A latent is a
    [C, S, S] floating-point array with finite values (what the loaders and the model take)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        shape, dtype = tuple(arr.shape), arr.dtype
        if arr.ndim != 3 or shape[1] != shape[2]:
            return False, f"shape {list(shape)} is not [C, S, S]", shape, dtype.str
        if dtype.kind != "f":
            return False, f"dtype {dtype} is not a floating-point type", shape, dtype.str
        if not np.isfinite(np.asarray(arr, dtype=np.float64)).all():
            return False, "holds NaN or infinite values", shape, dtype.str
        return True, "", shape, dtype.str
    except Exception as e:  # numpy raises many types for truncated or foreign files
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None, None


def build_manifest(root: str | Path, progress: bool = True) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root {str(root)!r} is not a directory")
    latents = folder_kind(root) == "latents"
    layout = decide(root, LATENT_EXTENSIONS if latents else IMAGE_EXTENSIONS)
    good, bad, sizes, modes, layouts = [], [], collections.Counter(), collections.Counter(), {}
    for rel, label in tqdm(layout.files, desc="checking", disable=not progress, unit="file"):
        if latents:
            ok, reason, size, dtype = check_latent(root / rel)
            layouts[rel] = (size, dtype)
        else:
            ok, reason, size, mode = check_image(root / rel)
            modes[mode] += ok
        if ok:
            good.append([rel, label])
            sizes[str(list(size))] += 1
        else:
            bad.append([rel, reason])
    m = {"root": str(root.resolve()), "kind": "latents" if latents else "images", "layout": layout.describe()}
    if latents and good:  # one shape, dtype and byte order: what batching (and DALI's reader) needs
        good, odd, common = _one_layout(root, good, layouts)
        for rel, _ in odd:
            (shape, dtype) = layouts[rel]
            bad.append([rel, f"shape {list(shape)}, dtype {np.dtype(dtype)} ({_order(dtype)}) differs from the "
                             f"folder's shape {list(common[0])}, dtype {np.dtype(common[1])} ({_order(common[1])})"])
            sizes[str(list(shape))] -= 1
        sizes = collections.Counter({k: v for k, v in sizes.items() if v > 0})
        m["other_layouts"] = dict(collections.Counter(_layout_name(*layouts[rel]) for rel, _ in odd).most_common())
        m["other_layout_files"] = [rel for rel, _ in odd]
    counts = collections.Counter(label for _, label in good)
    return {**m, "classes": layout.classes, "num_files": len(good),
            "counts": {str(k): v for k, v in sorted(counts.items())}, "sizes": dict(sizes.most_common()),
            **({} if latents else {"modes": dict(+modes)}), "files": good, "bad": bad}


def _layout_name(shape, dtype: str) -> str:
    return f"{list(shape)} {np.dtype(dtype)}" + (" big-endian" if dtype.startswith(">") else "")


def _one_layout(root: Path, good: list, layouts: dict) -> tuple[list, list, tuple]:
    """(kept, left out, the folder's layout): the (shape, dtype) of more than half of the readable
    arrays; refused when none has that many (which to keep would be a guess)."""
    groups = collections.Counter(layouts[rel] for rel, _ in good)
    common, n = groups.most_common(1)[0]
    if 2 * n <= len(good):
        shown = ", ".join(f"{_layout_name(*k)} ×{v}" for k, v in groups.most_common(4))
        raise DataError(f"{root}: no shape and dtype holds most of its {len(good)} readable arrays ({shown}"
                        f"{' ...' if len(groups) > 4 else ''}): convert them to one")
    return ([g for g in good if layouts[g[0]] == common], [g for g in good if layouts[g[0]] != common], common)


def left_out(m: dict) -> str:
    """What a manifest leaves out, in words ("" for nothing)."""
    odd = len(m.get("other_layout_files", []))
    unreadable = len(m["bad"]) - odd
    parts = [f"{unreadable} unreadable" if unreadable else "",
             f"{odd} of another shape or dtype ({', '.join(f'{k} ×{v}' for k, v in m['other_layouts'].items())})"
             if odd else ""]
    return " and ".join(x for x in parts if x)


def summary(m: dict) -> str:
    """One line: what a manifest holds and what it leaves out (for the command line and training)."""
    if m["classes"]:
        counts = m.get("counts", {})
        shown = ", ".join(f"{c} {counts.get(str(i), 0)}" for i, c in enumerate(m["classes"][:6]))
        what = f"{len(m['classes'])} classes ({shown}{', ...' if len(m['classes']) > 6 else ''})"
    else:
        what = "unlabelled"
    left = left_out(m)
    return (f"{m['root']}: {what}, {m['num_files']} usable {'arrays' if m.get('kind') == 'latents' else 'images'}"
            + (f"; left out: {left}" if left else ""))


def _order(dtype_str: str) -> str:
    return {"<": "little-endian", ">": "big-endian", "|": "no byte order", "=": "native order"}.get(dtype_str[0], "?")


def load_manifest(root: str | Path, path: str | Path | None = None) -> dict | None:
    """The manifest at `path` (which must exist) or ROOT/fasttrain-manifest.json (None if absent)."""
    if path and not Path(path).is_file():
        raise DataError(f"data.manifest {str(path)!r} does not exist")
    p = Path(path) if path else Path(root) / MANIFEST
    if not p.is_file():
        return None
    try:
        m = json.loads(p.read_text())
        files = [(str(f), int(y)) for f, y in m["files"]]
        if not isinstance(m["classes"], list) or not isinstance(m["bad"], list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise DataError(f"data.manifest: {p} is not a fasttrain manifest (run "
                        "`fasttrain data prepare` again)") from None
    m["files"] = [list(f) for f in files]
    return m


def load_encoder(spec: str):
    """'package.module:function' → the function (images [N, 3, S, S] in [-1, 1] → latents [N, ...])."""
    if ":" not in spec:
        raise InvalidInput(f"--encoder must look like module:function, got {spec!r}")
    mod, fn = spec.split(":", 1)
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and mod.startswith(e.name):  # the module itself is missing, not one it imports
            raise InvalidInput(f"--encoder {spec}: no module named {e.name!r}") from None
        raise
    if not callable(getattr(module, fn, None)):
        raise InvalidInput(f"--encoder {spec}: module {mod!r} has no function {fn!r}")
    return getattr(module, fn)


def encode_folder(manifest: dict, encoder, out: str | Path, image_size: int, batch_size: int = 64,
                  progress: bool = True) -> dict:
    """Write one .npy latent per good image (class subfolders kept) and return the latents' manifest."""
    import torch

    root, out = Path(manifest["root"]), Path(out)
    ds = ImageFolderDataset(str(root), image_size, 3, files=[tuple(f) for f in manifest["files"]])
    for lo in tqdm(range(0, len(ds), batch_size), desc="encoding", disable=not progress, unit="batch"):
        idx = range(lo, min(lo + batch_size, len(ds)))
        x = torch.stack([ds[i][0] for i in idx])
        with torch.no_grad():
            z = encoder(x)
        for i, zi in zip(idx, z):
            rel = Path(ds.files[i][0]).with_suffix(".npy")
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            np.save(out / rel, zi.detach().float().cpu().numpy())
    return build_manifest(out, progress=False)


def _is_manifest(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()).get("files"), list)
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


def check_outputs(root, out=None, latents_out=None, vae=None) -> None:
    """`data prepare`'s outputs kept apart from its inputs (paths.py): latents neither in, nor around,
    the image folder or the VAE's; the manifest file never over a file that is not a manifest, nor
    named like a data file (a loader would read it)."""
    reads = {"the image folder": str(root), "the VAE folder": vae}
    if latents_out:
        check_output(latents_out, "--latents-out", reads, holds_ok=False)
    if out:
        if Path(out).suffix.lower() in IMAGE_EXTENSIONS + LATENT_EXTENSIONS:
            raise InvalidInput(f"--out {out}: a manifest is JSON; a name ending in {Path(out).suffix} would be read "
                               f"as data")
        check_output_file(out, "--out", {"the VAE folder": vae}, earlier_result=_is_manifest)


def prepare(root: str | Path, out: str | Path | None = None, encoder: str | None = None,
            latents_out: str | Path | None = None, image_size: int = 256, batch_size: int = 64) -> dict:
    """The `fasttrain data prepare` command: check, optionally encode, write the manifest(s)."""
    check_outputs(root, out, latents_out)
    m = build_manifest(root)
    if not m["num_files"] and m["bad"]:  # nothing to train on: refused before the manifest is written
        shown = "; ".join(f"{rel}: {why}" for rel, why in m["bad"][:2])
        raise DataError(f"{root} holds no usable {m['kind']}: all {len(m['bad'])} file(s) are unreadable or of "
                        f"another kind ({shown}{' ...' if len(m['bad']) > 2 else ''})")
    path = Path(out) if out else Path(root) / MANIFEST
    if m["kind"] == "latents" and path.is_file():  # a rerun on latents from `--vae` keeps their record (encode.py)
        try:
            m["latents"] = json.loads(path.read_text())["latents"]
        except (ValueError, KeyError, TypeError):
            pass
    path.write_text(json.dumps(m, indent=1))
    result = {"manifest": str(path), "kind": m["kind"], "num_files": m["num_files"], "bad": m["bad"],
              "classes": m["classes"], "sizes": m["sizes"], "layout": m["layout"], "summary": summary(m)}
    if m["kind"] == "latents" and m["bad"] and m["num_files"]:  # streamed.refuse_bad_latents at train start
        result["refused_note"] = (f"training refuses this folder until the {len(m['bad'])} skipped file(s) are removed "
                                  f"or re-encoded (or data.skip_bad_latents=true trains on the {m['num_files']} "
                                  f"usable ones)")
    if encoder:
        if not latents_out:
            raise DataError("--latents-out is needed with --encoder")
        lm = encode_folder(m, load_encoder(encoder), latents_out, image_size, batch_size)
        lpath = Path(latents_out) / MANIFEST
        lpath.write_text(json.dumps(lm, indent=1))
        result["latents_manifest"] = str(lpath)
    return result
