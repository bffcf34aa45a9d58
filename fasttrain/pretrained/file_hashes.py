"""sha256 of model weight files, streamed and remembered between commands.

A run records the identity of the models it depends on (a LoRA run's base UNet, the VAE and the text
encoders that made cached latents and encodings) as the sha256 of their files, and checks it whenever it
is built again: on resume, `sample`, `eval`, `export`, `data prepare --resume`. An SDXL UNet is 5 GB and
SD3's T5 encoder 9 GB, so hashing them on every start costs tens of seconds. The digest of a set of
files is therefore kept in a small JSON cache keyed on each file's resolved path, size and modification
time (as git's index decides a file is unchanged without reading it); a file rewritten in place with the
same size and mtime would go unnoticed, which is the same trade git makes. The cache lives in
$FASTTRAIN_CACHE, else $XDG_CACHE_HOME/fasttrain, else ~/.cache/fasttrain; a cache that cannot be read
or written is ignored (the digest is computed as before), and it never changes a digest: the bytes
hashed are the ones the uncached code hashed.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

BLOCK = 1 << 24  # 16 MiB reads: the files are streamed, never held whole in memory


def cache_file() -> Path:
    root = os.environ.get("FASTTRAIN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "fasttrain"
    return Path(root) / "sha256.json"


def _key(files: list[Path], names: bool) -> str:
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return ("names:" if names else "bytes:") + "\n".join(parts)


def _read_cache() -> dict:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RuntimeError):  # RuntimeError: no home folder to find the cache in
        return {}


def _write_cache(key: str, digest: str) -> None:
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = digest
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sha256-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # atomic: concurrent ranks each leave a whole file
    except (OSError, RuntimeError):
        pass


def sha256(files, names: bool = False) -> str:
    """The sha256 of `files` in the given order: their bytes one after another, each preceded by its file
    name when `names` (a folder's weight files). Cached by path, size and mtime (module docstring)."""
    files = [Path(f) for f in files]
    key = _key(files, names)
    known = _read_cache().get(key)
    if isinstance(known, str):
        return known
    h = hashlib.sha256()
    for f in files:
        if names:
            h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(BLOCK), b""):
                h.update(block)
    digest = h.hexdigest()
    _write_cache(key, digest)
    return digest
