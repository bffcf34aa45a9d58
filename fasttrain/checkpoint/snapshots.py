"""Post-hoc EMA snapshots (optim/phema.py): the power-function EMA profiles at a training time, written
into RUN/phema/ as checkpoints are written (formats.py):

  RUN/phema/snapshot-<step>.pt   one process: one torch.save file, atomic (a temp file, then a rename)
  RUN/phema/snapshot-<step>/     several ranks: a sharded DCP folder, complete in <name>.tmp first

Each holds every tracked profile's parameters ("shadow": {"p0": {name: tensor}, ...}) and, as plain data,
what reads it alone: the run's config, data spec (and LoRA identity), the step, the images (the profile's
time t), the σ_rel of each profile. Disk: (number of profiles) × 4 bytes × trained parameters per
snapshot (docs/training.md). Read safely, as checkpoints are: `weights_only`, DCP through formats.py's
safe reader.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .formats import FORMAT, from_tensor, load_dcp, read_dcp_metadata, save_dcp, save_file, to_tensor

FOLDER = "phema"
KIND = "fasttrain post-hoc EMA snapshot"
_NAME = re.compile(r"snapshot-(\d+)(\.pt)?")


@dataclass(frozen=True)
class Snapshot:
    path: Path
    step: int


def folder(run_dir) -> Path:
    return Path(run_dir) / FOLDER


def name(step: int) -> str:
    return f"snapshot-{step:09d}"


def save(run_dir, averages, step: int, images: float, meta: dict, dist) -> Path:
    """Write the profiles of `averages` (a PowerEMA) at `step` (every rank calls this under torchrun)."""
    plain = {"format": FORMAT, "kind": KIND, **meta, "step": int(step), **averages.meta(), "images": float(images)}
    if dist.world_size > 1:
        return save_dcp(folder(run_dir) / name(step), {"shadow": averages.shadow_state(), "extra": to_tensor(plain)},
                        dist.is_main)
    return save_file(folder(run_dir) / f"{name(step)}.pt", {**plain, "shadow": averages.shadow_state()})


def find(run_dir) -> list[Snapshot]:
    """The complete snapshots of a run (or of a folder of snapshots), by step."""
    root = Path(run_dir)
    root = root if root.name == FOLDER or not (root / FOLDER).is_dir() else root / FOLDER
    if not root.is_dir():
        return []
    out = {}
    for p in root.iterdir():
        m = _NAME.fullmatch(p.name)
        if not m:
            continue
        if (m.group(2) and p.is_file()) or (not m.group(2) and (p / ".metadata").is_file()):
            out[int(m.group(1))] = Snapshot(p, int(m.group(1)))
    return [out[s] for s in sorted(out)]


def read_meta(snap: Snapshot) -> dict:
    """The plain part of a snapshot (config, data spec, step, images, σ_rels)."""
    if snap.path.is_file():
        state = _load(snap.path)
        return {k: v for k, v in state.items() if k != "shadow"}
    md = read_dcp_metadata(snap.path)
    entry = md.state_dict_metadata.get("extra")
    if entry is None or not hasattr(entry, "size"):
        raise CheckpointError(f"{snap.path} is not a {KIND} (no extra state)")
    holder = {"extra": torch.empty(entry.size, dtype=torch.uint8)}
    load_dcp(snap.path, holder)
    return _checked(from_tensor(holder["extra"], snap.path), snap.path)


def read_shadows(snap: Snapshot, like: dict[str, torch.Tensor], profiles: int) -> dict:
    """{"p0": {name: tensor}, ...} of a snapshot, full (unsharded) tensors; `like`: {name: a tensor of the
    parameter's shape} (the network built from the snapshot's config), for DCP's read."""
    if snap.path.is_file():
        state = _load(snap.path)
        shadow = state["shadow"]
    else:
        shadow = {f"p{k}": {n: torch.empty_like(t, device="cpu") for n, t in like.items()} for k in range(profiles)}
        load_dcp(snap.path, {"shadow": shadow})
    for k in range(profiles):
        got = shadow.get(f"p{k}")
        if got is None or set(got) != set(like):
            raise CheckpointError(f"{snap.path}: profile {k} does not hold the network's parameters")
    return shadow


def _load(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a snapshot, truncated, or holding objects other than tensors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read snapshot {path}: {first[:200]}") from None
    return _checked(state, path)


def _checked(state, path) -> dict:
    if not isinstance(state, dict) or state.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a {KIND}")
    return state


def remove_after(run_dir, step: int, every: int) -> None:
    """What a run resumed at `step` replaces: the snapshots after it (it writes them again; a shorter resumed
    run would keep the old run's later ones otherwise), and one at `step` off the `every` grid (the stopped
    invocation's last step, which the run that never stopped does not have)."""
    import shutil

    for s in find(run_dir):
        if s.step > step or (s.step == step and step % every):
            shutil.rmtree(s.path) if s.path.is_dir() else os.unlink(s.path)
