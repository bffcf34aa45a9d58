"""fasttrain's noise schedule, prediction type and step spacing ↔ a diffusers scheduler config, both ways.

    name, config = to_diffusers("linear", 1000, False, "eps", clip=True)   # for export/dispatch.py
    keys = from_diffusers(scheduler_config, where)   # {"diffusion.prediction": "v", ...} for a fine-tune
    notes = adopt(cfg, given)                        # a pretrained pipeline's scheduler into the run (configure.py)

Export: VP schedules as `DDIMScheduler`, whose config every stock VP scheduler reads the same way
(`X.from_config(pipe.scheduler.config)`): the schedule by its diffusers name (fasttrain's `linear` is
iDDPM's, 1e-4 → 0.02 scaled by 1000/T; `quad` is diffusers' `scaled_linear` from 1e-4 to 0.02;
`cosine` is `squaredcos_cap_v2`, Nichol & Dhariwal 2021, Eq. 17), `rescale_betas_zero_snr` for zero
terminal SNR (Lin et al. 2024, Alg. 1; DPM-Solver, Euler and UniPC then set the last ᾱ to 2⁻²⁴
themselves), `clip_sample` set explicitly (diffusers' default True would clip latents), trailing
spacing (solvers.py: the one spacing on which DDIMScheduler's t − T//n step and every other
scheduler's list agree, when n divides T), `set_alpha_to_one` (the last step lands on x̂0, as
fasttrain's). The flow schedule as `FlowMatchEulerDiscreteScheduler` with the run's `diffusion.flow_shift`
as its `shift` (its training sigmas, shift((t+1)/T), are fasttrain's grid; at shift 1 the model timestep
σ·T is fasttrain's t + 1, which export/remote_pipeline.py undoes; SD3's transformer takes σ·T itself).

Fine-tuning from a pipeline folder (`model.args.pretrained` with the network in a subfolder) takes its
scheduler: schedule, T, zero terminal SNR, prediction type and spacing. The betas are matched against
fasttrain's schedules as tables (whatever the config calls them); a scheduler fasttrain cannot train
with is one line, and so is a command-line setting that contradicts it.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, InvalidInput, UserError

PREDICTION_TYPES = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")
# the keys a pipeline's scheduler decides (a resumed fine-tune takes them from its checkpoint: configure.py)
KEYS = ("diffusion.schedule", "diffusion.T", "diffusion.zero_terminal_snr", "diffusion.flow_shift",
        "diffusion.prediction", "sample.spacing")


def betas_config(schedule: str, T: int) -> dict:
    """diffusers' name and end points of a fasttrain VP schedule (diffusion/schedule.py builds the same)."""
    if schedule == "linear":
        return {"beta_schedule": "linear", "beta_start": 1e-4 * 1000 / T, "beta_end": 0.02 * 1000 / T}
    if schedule == "scaled_linear":
        return {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
    if schedule == "quad":
        return {"beta_schedule": "scaled_linear", "beta_start": 1e-4, "beta_end": 0.02}
    if schedule == "cosine":
        return {"beta_schedule": "squaredcos_cap_v2", "beta_start": 1e-4, "beta_end": 0.02}
    raise ValueError(f"no diffusers betas for schedule {schedule!r}")


def to_diffusers(schedule: str, T: int, zero_terminal_snr: bool, prediction: str, clip: bool,
                 spacing: str = "trailing", shift: float = 1.0) -> tuple[str, dict]:
    """(scheduler class name, its config) for a run's schedule and prediction type (module docstring)."""
    if schedule == "flow":
        return "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": T, "shift": float(shift),
                                                   "use_dynamic_shifting": False}
    spacing = spacing if spacing in ("trailing", "leading") else "trailing"  # linspace: DDIM's step disagrees
    return "DDIMScheduler", {"num_train_timesteps": T, **betas_config(schedule, T), "trained_betas": None,
                             "rescale_betas_zero_snr": bool(zero_terminal_snr),
                             "prediction_type": PREDICTION_TYPES[prediction], "clip_sample": bool(clip),
                             "clip_sample_range": 1.0, "thresholding": False, "set_alpha_to_one": True,
                             "steps_offset": 0, "timestep_spacing": spacing}


def _diffusers_betas(config: dict, T: int, where: str) -> np.ndarray:
    """The betas a diffusers VP scheduler builds from its config, in float64."""
    if config.get("trained_betas") is not None:
        betas = np.asarray(config["trained_betas"], dtype=np.float64)
        if betas.shape != (T,):
            raise InvalidInput(f"{where}: trained_betas has {betas.size} values, num_train_timesteps is {T}")
        return betas
    kind, lo, hi = config.get("beta_schedule", "linear"), config.get("beta_start", 1e-4), config.get("beta_end", 0.02)
    if kind == "linear":
        return np.linspace(lo, hi, T, dtype=np.float64)
    if kind == "scaled_linear":
        return np.linspace(lo**0.5, hi**0.5, T, dtype=np.float64) ** 2
    if kind == "squaredcos_cap_v2":
        def abar(u):
            return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

        return np.array([min(1 - abar((i + 1) / T) / abar(i / T), 0.999) for i in range(T)])
    raise InvalidInput(f"{where}: beta_schedule {kind!r} has no fasttrain schedule (linear, scaled_linear, "
                       f"squaredcos_cap_v2 and their trained_betas do)")


def from_diffusers(config: dict, where: str) -> dict:
    """The run keys (KEYS) a diffusers scheduler config decides; InvalidInput where fasttrain cannot
    train with it."""
    from ..diffusion.schedule import SCHEDULES, schedule

    name = config.get("_class_name", "")
    T = config.get("num_train_timesteps", 1000)
    if not isinstance(T, int) or T < 2:
        raise InvalidInput(f"{where}: num_train_timesteps must be an integer >= 2, got {T!r}")
    if name in FLOW_SCHEDULERS:
        if config.get("use_dynamic_shifting"):  # Flux's resolution-dependent shift: no fixed table
            raise InvalidInput(f"{where}: use_dynamic_shifting (a shift that depends on the image size) has no "
                               f"fasttrain schedule (diffusion.flow_shift is one fixed shift)")
        shift = config.get("shift", 1.0)
        if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not 0 < shift < float("inf"):
            raise InvalidInput(f"{where}: shift must be a finite number > 0, got {shift!r}")
        return {"diffusion.schedule": "flow", "diffusion.T": T, "diffusion.zero_terminal_snr": False,
                "diffusion.flow_shift": float(shift), "diffusion.prediction": "flow"}
    pred = {v: k for k, v in PREDICTION_TYPES.items()}.get(config.get("prediction_type", "epsilon"))
    if pred is None:
        raise InvalidInput(f"{where}: prediction_type {config.get('prediction_type')!r} is not one fasttrain "
                           f"trains ({', '.join(PREDICTION_TYPES.values())})")
    zts = bool(config.get("rescale_betas_zero_snr", False))
    abar = np.cumprod(1.0 - _diffusers_betas(config, T, where))
    alpha = np.sqrt(abar)
    if zts:  # Lin et al. 2024, Alg. 1, as diffusion/schedule.py
        alpha = (alpha - alpha[-1]) * alpha[0] / (alpha[0] - alpha[-1])
    match = next((s for s in SCHEDULES if s != "flow" and _close(schedule(s, T, zts).alpha.numpy(), alpha)), None)
    if match is None:
        raise InvalidInput(f"{where}: its betas match none of fasttrain's schedules "
                           f"({', '.join(s for s in SCHEDULES if s != 'flow')}) at T={T}")
    keys = {"diffusion.schedule": match, "diffusion.T": T, "diffusion.zero_terminal_snr": zts,
            "diffusion.flow_shift": 1.0, "diffusion.prediction": pred}
    spacing = config.get("timestep_spacing", "leading")  # diffusers' default for the DDPM/DDIM family
    if spacing in ("trailing", "linspace", "leading"):
        keys["sample.spacing"] = spacing
    return keys


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.abs(a - b).max() < 1e-6)


def pipeline_scheduler(pretrained: str, subfolder: str | None) -> Path | None:
    """The scheduler_config.json of the pipeline a pretrained network comes from (its folder with the
    network in `subfolder`, or the network's folder inside a pipeline), if there is one."""
    pipeline = Path(pretrained) if subfolder else Path(pretrained).parent
    if not subfolder and not (pipeline / "model_index.json").is_file():
        return None
    path = pipeline / "scheduler" / "scheduler_config.json"
    return path if path.is_file() else None


def adopt(cfg: DictConfig, given: set[str]) -> list[str]:
    """A fine-tune from a pipeline folder takes its scheduler's keys (module docstring); `given` are the
    keys set on the command line, which must agree. Returns "key=value" for each key it changed."""
    from .model_folders import read_config

    args = cfg.model.args
    if cfg.model.name != "diffusers" or not args.get("pretrained"):
        return []
    path = pipeline_scheduler(args["pretrained"], args.get("subfolder"))
    if path is None:
        return []
    try:
        keys = from_diffusers(read_config(path.parent, path.name), str(path))
    except UserError as e:
        raise ConfigError(f"bad value for 'model.args.pretrained': {args['pretrained']!r} ({e})") from None
    changed = []
    for key, value in keys.items():
        current = OmegaConf.select(cfg, key)
        if current == value:
            continue
        if key in given:
            raise ConfigError(f"bad value for '{key}': {current!r} (the pretrained pipeline's scheduler, {path}, "
                              f"has {value!r}: a fine-tune keeps it; drop the override)")
        OmegaConf.update(cfg, key, value)
        changed.append(f"{key}={value}")
    return changed
