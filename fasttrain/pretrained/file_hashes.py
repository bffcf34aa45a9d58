"""sha256 of model weight files, streamed and remembered between commands.

A run records the identity of the models it depends on (a LoRA run's base UNet, the VAE and the text
encoders that made cached latents and encodings) as the sha256 of their files, and checks it whenever it
is built again: on resume, `sample`, `eval`, `export`, `data prepare --resume`. An SDXL UNet is 5 GB and
SD3's T5 encoder 9 GB, so hashing them on every start costs tens of seconds. The digest of a set of
files is therefore kept in a small JSON cache keyed on each file's resolved path, size and modification
time (as git's index decides a file is unchanged without reading it); a file rewritten in place with the
same size and mtime would go unnoticed, which is the same trade git makes. The cache lives in
$FASTTRAIN_CACHE, else $XDG_CACHE_HOME/fasttrain, else ~/.cache/fasttrain; a cache that cannot be read
or written (a file where the folder should be, a read-only folder, a corrupt file) is ignored with one
warning naming it (the digest is computed as before), and it never changes a digest: the bytes hashed
are the ones the uncached code hashed, and an entry that is not a sha256 is not believed.

Processes writing the cache at once (the ranks of a run, two commands) lose no entries and never leave
a corrupt file: each write takes an exclusive `fcntl.flock` on `sha256.json.lock`, reads the file again,
merges its entry in and replaces the file atomically (a temporary file, then `os.replace`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
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


DIGEST = re.compile(r"[0-9a-f]{64}")
_warned: set[str] = set()


def _warn(path, why: str) -> None:
    """One warning per cache path and reason: the digest is computed without the cache."""
    if (str(path), why) not in _warned:
        _warned.add((str(path), why))
        print(f"fasttrain: warning: the digest cache {path} {why}; digests are computed without it (set "
              f"$FASTTRAIN_CACHE to a writable folder)", file=sys.stderr)


def _read_cache(warn: bool = True) -> dict:
    try:
        path = cache_file()
    except RuntimeError:  # no home folder to find the cache in
        return {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError:
        if warn:
            _warn(path, "is not valid JSON (it is replaced on the next write)")
        return {}
    except OSError as e:
        if warn:
            _warn(*_problem(path, e))
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        if warn:
            _warn(path, "is not valid JSON (it is replaced on the next write)")
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str) and DIGEST.fullmatch(v)}  # a bad entry is no answer


def _problem(path: Path, e: OSError) -> tuple[Path, str]:
    """(the path at fault, why) for a cache that cannot be used: a file where its folder should be, else
    the error's own reason."""
    for q in path.parents:
        if q.exists():
            if not q.is_dir():
                return q, "is a file, not a folder"
            break
    return path, f"cannot be used ({e.strerror or type(e).__name__})"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`.lock while the cache is read, merged and replaced (POSIX flock)."""
    import fcntl

    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_cache(key: str, digest: str) -> None:
    try:
        path = cache_file()
    except RuntimeError:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            data = _read_cache(warn=False)  # what the other writers left, under the lock
            data[key] = digest
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sha256-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, whole
            tmp = None
    except OSError as e:
        _warn(*_problem(path, e))
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


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
