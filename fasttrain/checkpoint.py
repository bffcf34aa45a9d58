"""Checkpoints: the two formats, what goes into them, how they are found, and reading them safely.

Formats
  RUN/last.pt (and crash.pt)   one torch.save file, written by a single process: atomic (a temp file
                               unique to the process, then a rename), read with `weights_only=True`
  RUN/dcp/                     a sharded torch.distributed.checkpoint folder written by all ranks:
                               complete in RUN/dcp.tmp first, then renamed over the old one
`latest(run_dir)` is whichever of the two was written last.

Contents (`CheckpointManager` below builds and applies them; the trainer calls it)
  config, data_spec, step, images, model, ema, ema_n, optimizer, lr_sched, objective (sampler and
  statistics), data position, skipped-step count, interference history, gradient-scaler state,
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
    except Exception as e:  # noqa: BLE001 - any file that is not a checkpoint (text gives KeyError) is one line
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


# -- what goes into a training checkpoint, and back -----------------------------------------------
# Sections that must match for a checkpoint to be resumed (optim and train may change and are applied),
# except keys that change how, not what, is computed (every backend draws the same noise and batches).
RESUME_MUST_MATCH = ("data", "model", "diffusion")
RESUME_MAY_CHANGE = ("diffusion.backend", "data.backend", "data.num_workers")


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Saves a trainer's state in the format its process layout calls for and restores it, on this or
    another number of processes. The trainer (fasttrain/train.py) provides the pieces as attributes:
    cfg, spec, dist, model, opt, lr_sched, ema, objective, data, gen, scaler, interference, step, images,
    skipped (a device counter)."""

    def __init__(self, run_dir: str | os.PathLike, dist):
        self.run_dir, self.dist = Path(run_dir), dist

    def latest(self) -> Path | None:
        return latest(self.run_dir)

    def _plain(self, tr) -> dict:
        """Everything but the weights and optimizer tensors; per-rank parts gathered from every rank."""
        from dataclasses import asdict

        from omegaconf import OmegaConf

        from . import distributed as dist_utils

        ranks = dist_utils.all_gather_objects({"gen": tr.gen.get_state(), "rng": _rng_state(),
                                               "objective": tr.objective.rank_state()})
        return {"format": FORMAT, "config": OmegaConf.to_container(tr.cfg), "data_spec": asdict(tr.spec),
                "step": tr.step, "images": tr.images, "ema_n": tr.ema.n, "lr_sched": tr.lr_sched.state_dict(),
                "objective": tr.objective.extra_state(), "data": tr.data.state_dict(),
                "skipped": int(tr.skipped), "ranks": ranks, "world_size": self.dist.world_size,
                "interference": tr.interference.state_dict() if tr.interference else None,
                "scaler": tr.scaler.state_dict() if tr.scaler else None}

    def save(self, tr, name: str = "last.pt") -> Path | None:
        """RUN/last.pt (one process) or RUN/dcp (several ranks; another `name` is then skipped: a
        collective save could hang on a rank that died)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        ema = dict(zip(tr.ema.names, tr.ema.shadow))
        if self.dist.world_size > 1:
            if name != "last.pt":
                return None
            state = {"model": get_model_state_dict(tr.model), "optim": get_optimizer_state_dict(tr.model, tr.opt),
                     "ema": ema, "extra": to_tensor(self._plain(tr))}
            return save_dcp(self.run_dir / "dcp", state, self.dist.is_main)
        return save_file(self.run_dir / name, {**self._plain(tr), "model": get_model_state_dict(tr.model), "ema": ema,
                                               "optimizer": get_optimizer_state_dict(tr.model, tr.opt)})

    def restore(self, tr, path) -> list[str]:
        """Load a checkpoint into the trainer's pieces; returns the optimizer keys whose new values
        were applied (the config may change them on resume)."""
        from omegaconf import OmegaConf
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        from . import seeds
        from .optim import apply_optimizer_config

        path = Path(path)
        if path.is_dir():
            plain = read_dcp_extra(path)
            holder = {"model": get_model_state_dict(tr.model), "optim": get_optimizer_state_dict(tr.model, tr.opt),
                      "ema": dict(zip(tr.ema.names, tr.ema.shadow))}
            load_dcp(path, holder)
            model_sd, optim_sd, ema_sd, full = holder["model"], holder["optim"], holder["ema"], False
        else:
            plain = load_file(path)
            model_sd, optim_sd, ema_sd, full = plain["model"], plain["optimizer"], plain["ema"], True
        mine = OmegaConf.to_container(tr.cfg)
        for section in RESUME_MUST_MATCH:
            diff = [k for k in config_diff(plain["config"][section], mine[section], section + ".")
                    if k not in RESUME_MAY_CHANGE]
            if diff:
                raise ValueError(f"cannot resume {path}: config key '{diff[0]}' differs from the checkpoint")
        world, rank = self.dist.world_size, self.dist.rank
        opts = StateDictOptions(full_state_dict=full and world > 1)
        set_model_state_dict(tr.model, model_sd, options=opts)
        set_optimizer_state_dict(tr.model, tr.opt, optim_sd, options=opts)
        tr.ema.load_state_dict({"n": plain["ema_n"], "shadow": ema_sd})
        tr.lr_sched.load_state_dict(plain["lr_sched"])
        if tr.scaler and plain.get("scaler"):
            tr.scaler.load_state_dict(plain["scaler"])
        changed = apply_optimizer_config(tr.opt, tr.lr_sched, plain["config"]["optim"], mine["optim"])
        tr.objective.load_extra_state(plain["objective"])
        if tr.interference and plain.get("interference"):
            tr.interference.load_state_dict(plain["interference"], tr.device)
        ranks = plain["ranks"]
        data = dict(plain["data"])
        old_world = int(plain.get("world_size", len(ranks)))
        if old_world != world:  # shards of another size (n // world): keep the fraction of the epoch
            data["pos"] = int(data["pos"]) * old_world // world
        tr.data.load_state_dict(data)
        if len(ranks) == world:  # the same layout: continue every rank's streams exactly
            tr.gen.set_state(ranks[rank]["gen"])
            _set_rng_state(ranks[rank]["rng"])
            tr.objective.load_rank_state(ranks[rank]["objective"])
        else:  # another world size: fresh per-rank streams; rank 0 takes every rank's pending statistics
            tr.gen.manual_seed(seeds.derive(tr.cfg.train.seed, "reseed", rank, int(plain["step"])))
            windows = [r["objective"]["window"] for r in ranks if r["objective"]["window"] is not None]
            merged = {"window": tr.objective.stats.merge_window_states(windows)} if windows and rank == 0 else None
            tr.objective.load_rank_state(merged)
        tr.step, tr.images = int(plain["step"]), int(plain.get("images", 0))
        tr.skipped.fill_(int(plain.get("skipped", 0)))
        return changed
