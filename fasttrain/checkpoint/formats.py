"""Checkpoint formats and reading them safely.

  RUN/last.pt (and crash.pt)   one torch.save file, written by a single process: atomic (a temp file
                               unique to the process, then a rename), read with `weights_only=True`
  RUN/dcp/                     a sharded torch.distributed.checkpoint folder written by all ranks:
                               complete in RUN/dcp.tmp first, then swapped in (RUN/dcp.old meanwhile)
`latest(run_dir)` is whichever of the two was written last.

Contents (format 4; manager.py builds them): config, data_spec and world_size; model, ema ({"n",
"shadow"}) and optimizer (tensors, sharded in DCP); the named states of the trainer's components
(train: step/images/skipped, lr_sched, objective, data, interference, scaler); ranks: one entry per
process of per-rank state (RNG streams, the pending statistics window). In a DCP folder everything
but the tensors travels as one uint8 tensor, "extra". Older files are upgraded on reading: format 2's
layout; format 3's conventions written into its config (the DiT's and UNet's `convention: legacy`,
`sample.spacing: linspace`), which format 4 changed for new runs.
The model bundle (bundle.py) needs only config, data_spec, model, ema and train: `read_bundle_state`.

Safety: a checkpoint is data, never code. Files go through `torch.load(weights_only=True)`; DCP's
`.metadata` is a plain pickle that torch reads with `pickle.load`, so it is read here through an
unpickler that admits only DCP's own metadata classes, dtypes and paths; DCP's byte entries (the
optimizer's hyper-parameters) would be `torch.load`ed with `weights_only=False`, so fasttrain's load
planner reads them with `weights_only=True` first. Every failure is one line naming the file.
"""
from __future__ import annotations

import copy
import io
import os
import pickle
import shutil
import uuid
from pathlib import Path

import torch

from ..errors import CheckpointError

FORMAT = 4
REQUIRED = ("config", "data_spec", "model", "ema")


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


def load_file(path: str | os.PathLike, mmap: bool = False) -> dict:
    """A checkpoint file's state (`mmap`: its tensors mapped, not read, for what needs the rest)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # any file that is not a checkpoint (text gives KeyError) is one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            first = "it holds objects other than tensors and plain data (refused: loading it could run code)"
        raise CheckpointError(f"cannot read checkpoint {path}: {first}") from None
    state = _upgrade(state) if isinstance(state, dict) else state
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
    except Exception as e:  # any failure here means a malformed checkpoint
        raise CheckpointError(f"cannot read the state in {where}: {type(e).__name__}") from None


def _upgrade(state: dict) -> dict:
    """An older checkpoint in format 4's layout and conventions."""
    if state.get("format", 2) < 3:
        state = _upgrade_2(state)
    if state["format"] < 4:
        state = _upgrade_3(state)
    return state


def _upgrade_3(state: dict) -> dict:
    """Format 3 → 4: the conventions its runs used, which new runs' defaults changed, written into its
    config: fasttrain's DiTs and UNets `model.args.convention: legacy` (models/dit.py, models/unet.py)
    and `sample.spacing: linspace` (diffusion/solvers.py)."""
    from ..models import MODELS

    config = copy.deepcopy(state.get("config"))
    if isinstance(config, dict):
        model, sample = config.get("model") or {}, config.setdefault("sample", {})
        args = model.get("args") or {}
        if model.get("name") in MODELS and "convention" in MODELS.args(model["name"]):
            model["args"] = {**args, "convention": args.get("convention", "legacy")}
        if isinstance(sample, dict):
            sample.setdefault("spacing", "linspace")
    return {**state, "config": config, "format": 4}


def _upgrade_2(state: dict) -> dict:
    """A format-2 checkpoint in format 3's layout (train state, EMA with its count, per-rank RNGs as one
    entry, the objective as its module state, the data position with its world size)."""
    state = dict(state)
    world = int(state.get("world_size", len(state.get("ranks", [])) or 1))
    state["train"] = {"step": int(state.pop("step", 0)), "images": int(state.pop("images", 0)),
                      "skipped": int(state.pop("skipped", 0))}
    if "ema" in state and "shadow" not in state["ema"]:
        state["ema"] = {"n": int(state.pop("ema_n", 0)), "shadow": state["ema"]}
    if isinstance(state.get("objective"), dict):
        state["objective"] = {"_extra_state": state["objective"]}
    if isinstance(state.get("data"), dict):
        state["data"] = {**state["data"], "world_size": world}
    state["ranks"] = [{"rng": {"gen": r["gen"], **r["rng"]}, "objective": r["objective"]}
                      for r in state.get("ranks", [])]
    state["format"] = 3
    return state


def train_state(state: dict) -> dict:
    """{"step", "images", "skipped"} of a checkpoint's plain state."""
    t = state["train"]
    return {"step": int(t["step"]), "images": int(t.get("images", 0)), "skipped": int(t.get("skipped", 0))}


def load_weights(model: torch.nn.Module, state_dict: dict, path) -> None:
    """`model.load_state_dict` with a one-line CheckpointError naming the file when the weights do not
    fit the configured model (another model, other sizes)."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the weights do not fit the configured model "
                              f"({_first(e)[:200]})") from None


def _first(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    # torch's load_state_dict: "Error(s) in loading state_dict for X:" then the first mismatch
    return lines[0] + (" " + lines[1] if len(lines) > 1 and lines[0].endswith(":") else "")


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
    except Exception as e:  # truncated or foreign pickles raise many types
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
            except Exception:  # anything but plain data is refused
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
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if is_main:
        _recover_swap(final)
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if is_main:  # replace the previous checkpoint only once the new one is complete; at every instant a
        if final.exists():  # complete one is `final` or `old` (latest() looks at both)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _recover_swap(final: Path) -> None:
    """After a save killed between its two renames, the previous checkpoint waits in `final.old`."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        if final.exists():
            shutil.rmtree(old)  # killed after the swap, before the clean-up
        else:
            old.rename(final)


def load_dcp(folder: str | os.PathLike, state: dict) -> dict:
    """Fill `state` (tensors of the right shapes, sharded or not) from a DCP folder, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    read_dcp_metadata(folder)  # a clear error before DCP's own, more cryptic ones
    try:
        dcp.load(state, storage_reader=_reader(folder), planner=_planner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # missing, mismatched or refused shards
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
    extra = _upgrade(from_tensor(holder["extra"], folder))
    _check({**extra, "model": 0, "ema": 0}, folder)
    return extra


# -- finding ---------------------------------------------------------------------------------------
def latest(run_dir: str | os.PathLike) -> Path | None:
    """RUN/last.pt (one process) or RUN/dcp (several), whichever was written last; RUN/dcp.old when a
    save was killed while swapping the folders (save_dcp)."""
    run_dir = Path(run_dir)
    dcp = run_dir / "dcp" if (run_dir / "dcp" / ".metadata").is_file() else run_dir / "dcp.old"
    found = [p for p in (run_dir / "last.pt", dcp) if p.is_file() or (p / ".metadata").is_file()]
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


def read_plain(path: str | os.PathLike, mmap: bool = False) -> dict:
    """The plain part of any checkpoint (config, step, objective state, per-rank windows)."""
    path = resolve(path)
    return load_file(path, mmap) if path.is_file() else read_dcp_extra(path)


def read_bundle_state(path: str | os.PathLike, build_model) -> tuple[dict, dict, dict]:
    """(plain state, model state dict, EMA state {"n", "shadow"}) from a checkpoint, without any process group.
    `build_model(plain_state)` returns the (unsharded) model the weights belong to."""
    path = resolve(path)
    if path.is_file():
        state = load_file(path)
        return state, state["model"], state["ema"]
    extra = read_dcp_extra(path)
    model = build_model(extra)
    from ..optim.ema import trained
    from ..pretrained import lora

    holder = {"model": lora.checkpoint_view(model, {k: v.detach().clone() for k, v in model.state_dict().items()}),
              "ema": {k: v.detach().clone() for k, v in trained(model)}}
    load_dcp(path, holder)
    return extra, holder["model"], {"n": extra["ema"]["n"], "shadow": holder["ema"]}
