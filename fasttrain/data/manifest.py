"""Data-set manifests: which files a folder holds, their labels, and which files are unreadable.

`fasttrain data prepare ROOT` checks every image once (PIL opens and fully decodes it), lists the
corrupt ones instead of letting a loader crash on them mid-epoch, and writes ROOT/fasttrain-manifest.json
with the counts, classes and image sizes. Loaders read their file list from the manifest; without
one they scan the folder (and, for DALI, check the images first, since a corrupt JPEG stops its
pipeline). Optionally the images are encoded to .npy latents by a user-supplied encoder.
"""
from __future__ import annotations

import collections
import importlib
import json
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from ..errors import DataError, InvalidInput
from .folder import IMAGE_EXTENSIONS, LATENT_EXTENSIONS, ImageFolderDataset, scan

MANIFEST = "fasttrain-manifest.json"


def check_image(path: Path) -> tuple[bool, str, tuple[int, int] | None]:
    """Fully decode an image; (ok, reason, (width, height))."""
    try:
        with Image.open(path) as im:
            im.load()
            return True, "", im.size
    except Exception as e:  # PIL raises many types for truncated or corrupt files
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None


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


def folder_kind(root: Path) -> str:
    """"images" or "latents", by what the folder holds; a folder with both is refused (one line): its
    kind would otherwise be a guess that silently drops the other files."""
    images = next((f for f in root.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS), None)
    arrays = next((f for f in root.rglob("*") if f.suffix.lower() in LATENT_EXTENSIONS), None)
    if images is not None and arrays is not None:
        n_img = sum(1 for f in root.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS)
        n_arr = sum(1 for f in root.rglob("*") if f.suffix.lower() in LATENT_EXTENSIONS)
        raise DataError(f"{root} holds both images ({n_img}, e.g. {images.relative_to(root)}) and .npy arrays "
                        f"({n_arr}, e.g. {arrays.relative_to(root)}): a data folder holds one kind, move the others")
    return "latents" if arrays is not None else "images"


def build_manifest(root: str | Path, progress: bool = True) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root {str(root)!r} is not a directory")
    latents = folder_kind(root) == "latents"
    files, classes = scan(root, LATENT_EXTENSIONS if latents else IMAGE_EXTENSIONS)
    good, bad, sizes, layouts = [], [], collections.Counter(), {}
    for rel, label in tqdm(files, desc="checking", disable=not progress, unit="file"):
        if latents:
            ok, reason, size, dtype = check_latent(root / rel)
            layouts[rel] = (size, dtype)
        else:
            ok, reason, size = check_image(root / rel)
        if ok:
            good.append([rel, label])
            sizes[str(list(size))] += 1
        else:
            bad.append([rel, reason])
    if latents and good:  # one shape, dtype and byte order: what batching (and DALI's reader) needs
        common = collections.Counter(layouts[rel] for rel, _ in good).most_common(1)[0][0]
        odd = [(rel, y) for rel, y in good if layouts[rel] != common]
        for rel, _ in odd:
            (shape, dtype) = layouts[rel]
            bad.append([rel, f"shape {list(shape)}, dtype {np.dtype(dtype)} ({_order(dtype)}) differs from the "
                             f"folder's shape {list(common[0])}, dtype {np.dtype(common[1])} ({_order(common[1])})"])
            sizes[str(list(shape))] -= 1
        good = [g for g in good if layouts[g[0]] == common]
        sizes = collections.Counter({k: v for k, v in sizes.items() if v > 0})
    counts = collections.Counter(label for _, label in good)
    return {"root": str(root.resolve()), "kind": "latents" if latents else "images", "classes": classes,
            "num_files": len(good), "counts": {str(k): v for k, v in sorted(counts.items())},
            "sizes": dict(sizes.most_common()), "files": good, "bad": bad}


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


def prepare(root: str | Path, out: str | Path | None = None, encoder: str | None = None,
            latents_out: str | Path | None = None, image_size: int = 256, batch_size: int = 64) -> dict:
    """The `fasttrain data prepare` command: check, optionally encode, write the manifest(s)."""
    m = build_manifest(root)
    path = Path(out) if out else Path(root) / MANIFEST
    if m["kind"] == "latents" and path.is_file():  # a rerun on latents from `--vae` keeps their record (encode.py)
        try:
            m["latents"] = json.loads(path.read_text())["latents"]
        except (ValueError, KeyError, TypeError):
            pass
    path.write_text(json.dumps(m, indent=1))
    result = {"manifest": str(path), "num_files": m["num_files"], "bad": m["bad"], "classes": m["classes"],
              "sizes": m["sizes"]}
    if encoder:
        if not latents_out:
            raise DataError("--latents-out is needed with --encoder")
        lm = encode_folder(m, load_encoder(encoder), latents_out, image_size, batch_size)
        lpath = Path(latents_out) / MANIFEST
        lpath.write_text(json.dumps(lm, indent=1))
        result["latents_manifest"] = str(lpath)
    return result
