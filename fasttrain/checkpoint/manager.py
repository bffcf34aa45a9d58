"""The checkpoint manager: saves and restores named components, in the format the process layout calls
for (formats.py), on this or another number of processes.

As torchtitan's checkpointer (`components/checkpointer/dcp.py`), it is given the objects to persist,
not the trainer:

    CheckpointManager(run_dir, dist, meta={"config": ..., "data_spec": ...},
                      model=net, optimizer=opt, ema=ema,
                      states={"train": ..., "lr_sched": ..., "objective": ..., "data": ...},
                      rank_states={"rng": ..., "objective": ...})

  model, optimizer  tensors, sharded under FSDP (torch's get/set_*_state_dict)
  ema               `state_dict()` = {"n", "shadow": {name: tensor}}; the shadows are sharded like the model
  states            objects with `state_dict()`/`load_state_dict()` of plain data (None: not used in
                    this run), identical on every rank
  averages          further averages of the weights by name (optim/phema.py's PowerEMA): `meta()` plain,
                    `shadow_state()` tensors sharded like the model, `load_state_dict({**meta, "shadow"})`;
                    a run that keeps one cannot resume a checkpoint without it
  rank_states       objects with `rank_state()` (this process's part) and
                    `load_rank_states(all ranks' parts, rank, world_size)`, which decides what a rank takes
                    when the world size changed
Resuming checks that the config sections that define the model and the objective match the
checkpoint's (`RESUME_MUST_MATCH`); `restore` returns the checkpoint's config so the caller can apply
what may change (the optimizer's settings).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from ..pretrained import lora
from .formats import FORMAT, latest, load_dcp, load_file, read_dcp_extra, save_dcp, save_file, to_tensor

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


class CheckpointManager:
    def __init__(self, run_dir: str | os.PathLike, dist, *, meta: dict, model, optimizer, ema, states: dict,
                 rank_states: dict, averages: dict | None = None):
        self.run_dir, self.dist = Path(run_dir), dist
        self.meta, self.model, self.optimizer, self.ema = meta, model, optimizer, ema
        self.states = {k: v for k, v in states.items() if v is not None}
        self.rank_states = rank_states
        self.averages = {k: v for k, v in (averages or {}).items() if v is not None}

    def latest(self) -> Path | None:
        return latest(self.run_dir)

    def _plain(self) -> dict:
        """Everything but the weights and optimizer tensors; per-rank parts gathered from every rank."""
        from ..parallel import distributed as dist_utils

        ranks = dist_utils.all_gather_objects({k: v.rank_state() for k, v in self.rank_states.items()})
        ema = self.ema.state_dict()
        out = {"format": FORMAT, **self.meta, "world_size": self.dist.world_size, "ranks": ranks,
               **{k: v.state_dict() for k, v in self.states.items()}, "ema": {"n": ema["n"]}}
        if self.averages:
            out["averages"] = {k: v.meta() for k, v in self.averages.items()}
        return out

    def save(self, name: str = "last.pt") -> Path | None:
        """RUN/last.pt (one process) or RUN/dcp (several ranks; another `name` is then skipped: a
        collective save could hang on a rank that died)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        shadow = self.ema.state_dict()["shadow"]
        plain = self._plain()
        model_sd = lora.checkpoint_view(self.model, get_model_state_dict(self.model))  # LoRA: the adapter
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        if self.dist.world_size > 1:
            if name != "last.pt":
                return None
            state = {"model": model_sd, "optim": optim_sd, "ema": shadow, "extra": to_tensor(plain)}
            if self.averages:
                state["averages"] = {k: v.shadow_state() for k, v in self.averages.items()}
            return save_dcp(self.run_dir / "dcp", state, self.dist.is_main)
        plain["ema"]["shadow"] = shadow
        for k, v in self.averages.items():
            plain["averages"][k]["shadow"] = v.shadow_state()
        return save_file(self.run_dir / name, {**plain, "model": model_sd, "optimizer": optim_sd})

    def restore(self, path) -> dict:
        """Load a checkpoint into the components; returns its config (for what may change on resume)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(path)
        if path.is_dir():
            plain = read_dcp_extra(path)
            self._check_config(plain, path)
            holder = {"model": lora.checkpoint_view(self.model, get_model_state_dict(self.model)),
                      "optim": get_optimizer_state_dict(self.model, self.optimizer),
                      "ema": self.ema.state_dict()["shadow"]}
            self._check_averages(plain, path)
            if self.averages:  # read in place into the live (sharded) tensors
                holder["averages"] = {k: v.shadow_state() for k, v in self.averages.items()}
            load_dcp(path, holder)
            for k in self.averages:
                plain["averages"][k]["shadow"] = holder["averages"][k]
            model_sd, optim_sd, shadow, full = holder["model"], holder["optim"], holder["ema"], False
        else:
            plain = load_file(path)
            self._check_config(plain, path)
            model_sd, optim_sd, shadow, full = plain["model"], plain["optimizer"], plain["ema"]["shadow"], True
            self._check_averages(plain, path)
        model_sd = lora.loadable(plain.get("lora"), self.model, model_sd, path, full)  # a LoRA run's recorded base
        world, rank = self.dist.world_size, self.dist.rank
        opts = StateDictOptions(full_state_dict=full and world > 1, strict=not (lora.identity(self.model) and not full))
        try:
            set_model_state_dict(self.model, model_sd, options=opts)
        except (RuntimeError, KeyError, ValueError) as e:  # another model or other sizes
            raise CheckpointError(f"cannot resume {path}: the weights do not fit the configured model "
                                  f"({str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__})"
                                  ) from None
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)
        self.ema.load_state_dict({"n": plain["ema"]["n"], "shadow": shadow})
        for k, v in self.averages.items():
            v.load_state_dict(plain["averages"][k])
        for name, obj in self.states.items():
            if plain.get(name) is not None:
                obj.load_state_dict(plain[name])
        for name, obj in self.rank_states.items():
            obj.load_rank_states([r[name] for r in plain["ranks"]], rank, world)
        return plain["config"]

    def _check_averages(self, plain: dict, path) -> None:
        """Every average this run keeps is in the checkpoint, with the settings it was written with (the
        post-hoc EMA profiles track from step 0: a run that did not keep them cannot start them midway)."""
        from ..errors import UserError

        for k, v in self.averages.items():
            saved = (plain.get("averages") or {}).get(k)
            if saved is None:
                raise CheckpointError(f"cannot resume {path}: it holds no {k} profiles (they were off when it was "
                                      f"written, and they track from step 0): resume with {k}.every=0")
            try:
                v.check_meta(saved)
            except UserError as e:
                raise CheckpointError(f"cannot resume {path}: {e}") from None

    def _check_config(self, plain: dict, path) -> None:
        from omegaconf import OmegaConf

        from ..config import Config

        mine = self.meta["config"]
        try:  # keys added since the checkpoint was written take their defaults
            theirs = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(Config), plain["config"]))
        except Exception as e:  # a config from another version or hand-edited
            raise CheckpointError(f"cannot resume {path}: its config does not fit this version "
                                  f"({type(e).__name__})") from None
        for section in RESUME_MUST_MATCH:
            diff = [k for k in config_diff(theirs[section], mine[section], section + ".")
                    if k not in RESUME_MAY_CHANGE]
            if diff:
                raise CheckpointError(f"cannot resume {path}: config key '{diff[0]}' differs from the checkpoint")
