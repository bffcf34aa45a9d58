"""Checkpoints: the two formats, what goes into them, how they are found, and reading them safely.

Formats
  RUN/last.pt (and crash.pt)   one torch.save file, written by a single process: atomic (a temp file
                               unique to the process, then a rename), read with `weights_only=True`
  RUN/dcp/                     a sharded torch.distributed.checkpoint folder written by all ranks:
                               complete in RUN/dcp.tmp first, then renamed over the old one
`latest(run_dir)` is whichever of the two was written last.

Contents (`TrainState` keys; `Trainer.state` builds them, `Trainer.restore` applies them)
  config, data_spec, step, images, model, ema, ema_n, optimizer, lr_sched, objective, data,
  ranks (one entry per process: generator and RNG states, that rank's pending statistics window)
The bundle (bundle.py) needs only config, data_spec, model, ema and step: `read_bundle_state`.

Safety: a checkpoint is data, never code. Files go through `torch.load(weights_only=True)`; DCP's
`.metadata` is a plain pickle that torch reads with `pickle.load`, so it is read here through an
unpickler that admits only DCP's own metadata classes, dtypes and paths; DCP's byte entries (the
optimizer's hyper-parameters) would be `torch.load`ed with `weights_only=False`, so fasttrain's load
planner reads them with `weights_only=True` first. Every failure is one line naming the file.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from pathlib import Path

import torch

from .errors import UserError

FORMAT = 2
REQUIRED = ("config", "data_spec", "step", "model", "ema")


class CheckpointError(ValueError):
    """An unreadable, malformed or unsafe checkpoint; the message is one line naming the path."""


# -- single files --------------------------------------------------------------------------------
def save_file(path: str | os.PathLike, state: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # unique per process
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_file(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, TypeError, AttributeError,
            ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            first = "it holds objects other than tensors and plain data (refused: loading it could run code)"
        raise CheckpointError(f"cannot read checkpoint {path}: {first}") from None
    _check(state, path)
    return state


def _check(state, path) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a fasttrain checkpoint (it holds a {type(state).__name__})")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a fasttrain checkpoint of this version (no {', '.join(missing)})")


def to_tensor(obj) -> torch.Tensor:
    """Small plain state as a uint8 tensor (how it travels inside DCP folders)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_tensor(t: torch.Tensor, where) -> dict:
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means a malformed checkpoint
        raise CheckpointError(f"cannot read the state in {where}: {type(e).__name__}") from None


# -- DCP folders ---------------------------------------------------------------------------------
_MD = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Exact (module, name) pairs only: pickle protocol 4 resolves dotted names through a module's
    attributes (`metadata.os.system`), so admitting a whole module would admit what it imports."""

    def find_class(self, module, name):
        ok = "." not in name and ((module, name) in _DCP_CLASSES
                                  or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise CheckpointError(f"it references {module}.{name}, which is not part of a checkpoint's metadata")
        return super().find_class(module, name)


def read_dcp_metadata(folder: str | os.PathLike):
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"refusing to read {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - truncated or foreign pickles raise many types
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}") from None


def _reader(folder):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_dcp_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(folder))


def _planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's byte entries (e.g. optimizer hyper-parameters) through `weights_only=True`."""

        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, weights_only=True)
            except Exception:  # noqa: BLE001 - anything but plain data is refused
                raise CheckpointError(f"refusing the entry {read_item.dest_index.fqn!r}: it holds objects other "
                                      f"than tensors and plain data") from None
            value = io.BytesIO()
            torch.save(obj, value)
            value.seek(0)
            super().load_bytes(read_item, value)  # now known to be plain data

    return WeightsOnlyPlanner()


def save_dcp(folder: str | os.PathLike, state: dict, is_main: bool) -> Path:
    """All ranks call this; `state` holds tensors/DTensors only (plain state via `to_tensor`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if is_main:  # replace the previous checkpoint only once the new one is complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def load_dcp(folder: str | os.PathLike, state: dict) -> dict:
    """Fill `state` (tensors of the right shapes, sharded or not) from a DCP folder, in place."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    read_dcp_metadata(folder)  # a clear error before DCP's own, more cryptic ones
    try:
        dcp.load(state, storage_reader=_reader(folder), planner=_planner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - missing, mismatched or refused shards
        text = str(e)
        ours = [line.split("CheckpointError: ", 1)[1] for line in text.splitlines() if "CheckpointError: " in line]
        first = ours[0] if ours else (text.strip().splitlines()[0] if text.strip() else type(e).__name__)
        raise CheckpointError(f"cannot read checkpoint {folder}: {first[:200]}") from None
    return state


def read_dcp_extra(folder: str | os.PathLike) -> dict:
    """The plain part of a DCP checkpoint (config, step, ...), without the weights."""
    md = read_dcp_metadata(folder)
    meta = md.state_dict_metadata.get("extra")
    if meta is None or not hasattr(meta, "size"):
        raise CheckpointError(f"{folder} is not a fasttrain checkpoint (no extra state)")
    holder = {"extra": torch.empty(meta.size, dtype=torch.uint8)}
    load_dcp(folder, holder)
    extra = from_tensor(holder["extra"], folder)
    _check({**extra, "model": 0, "ema": 0}, folder)
    return extra


# -- finding ---------------------------------------------------------------------------------------
def latest(run_dir: str | os.PathLike) -> Path | None:
    """RUN/last.pt (one process) or RUN/dcp (several), whichever was written last."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / "last.pt", run_dir / "dcp") if p.is_file() or (p / ".metadata").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve(path: str | os.PathLike) -> Path:
    """A run directory, a checkpoint file or a DCP folder → the checkpoint to read."""
    path = Path(path)
    if path.is_dir() and not (path / ".metadata").is_file():
        found = latest(path)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} (expected last.pt or dcp/)")
        return found
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def read_plain(path: str | os.PathLike) -> dict:
    """The plain part of any checkpoint (config, step, objective state, per-rank windows)."""
    path = resolve(path)
    return load_file(path) if path.is_file() else read_dcp_extra(path)


def read_bundle_state(path: str | os.PathLike, build_model) -> tuple[dict, dict, dict]:
    """(plain state, model state dict, EMA state dict) from a checkpoint, without any process group.
    `build_model(plain_state)` returns the (unsharded) model the weights belong to."""
    path = resolve(path)
    if path.is_file():
        state = load_file(path)
        return state, state["model"], state["ema"]
    extra = read_dcp_extra(path)
    model = build_model(extra)
    holder = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
              "ema": {k: v.detach().clone() for k, v in model.named_parameters()}}
    load_dcp(path, holder)
    return extra, holder["model"], holder["ema"]


# -- the run directory -----------------------------------------------------------------------------
class RunLock:
    """One trainer per run directory: an exclusive lock on RUN/.lock for the process's lifetime."""

    def __init__(self, run_dir: str | os.PathLike):
        import fcntl

        self.path = Path(run_dir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise UserError(f"another fasttrain process is using {self.path.parent} "
                               f"(wait for it or choose another run_dir)") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()

    def release(self) -> None:
        import fcntl

        if not self._f.closed:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()


def archive_previous_run(run_dir: str | os.PathLike) -> Path | None:
    """`--restart`: move what an earlier run left (checkpoints, metrics, plots) into
    RUN/previous-<n>/, so a fresh run starts clean and nothing is lost."""
    run_dir = Path(run_dir)
    items = [p for p in run_dir.iterdir() if not p.name.startswith((".", "previous-"))] if run_dir.is_dir() else []
    if not items:
        return None
    n = 1
    while (run_dir / f"previous-{n}").exists():
        n += 1
    dest = run_dir / f"previous-{n}"
    dest.mkdir()
    for p in items:
        p.rename(dest / p.name)
    return dest
