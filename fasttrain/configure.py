"""Configure a run: read the config (config.py: schema and loading), then let every registered
component check its own part, so that a run that starts will not fail on its settings later.

    cfg = load_config("default", ["diffusion.prediction=v", "model.args.ch=48"])

Each check lives with its component: registries check names and argument types (registry.py), a
model family its sizes (`check` registered with the model), a prediction kind its combination with
the schedule (`objective_class(...).check_config`), samplers and weightings their values (built once
here), solvers their options (`solvers.check_options`), the noise options their combinations
(`noise_options.check_config`). What is left here is naming the key: every
error is one `ConfigError` line.
"""
from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import plain, read_config
from .errors import ConfigError, MissingDependency, UserError

__all__ = ["choices", "load_config", "validate"]


def choices() -> dict[str, tuple[str, ...]]:
    """Every key whose values come from a registry or a component's fixed set, for --help and checks."""
    from .data import BACKENDS as DATA_BACKENDS
    from .data import names as data_names
    from .diffusion import SAMPLERS, SCHEDULES, WEIGHTINGS
    from .diffusion.objective import BACKENDS, prediction_kinds
    from .diffusion.solvers import SOLVERS
    from .generation.evaluate import EXTRACTORS
    from .models import MODELS
    from .parallel.precision import PRECISIONS
    from .parallel.wrap import AC_MODES, COMPILE, COMPILE_MODES, STRATEGIES
    from .pretrained.lora import BASE_DTYPES

    return {"data.name": data_names(), "data.backend": DATA_BACKENDS, "model.name": MODELS.names(),
            "diffusion.schedule": SCHEDULES, "diffusion.prediction": prediction_kinds(),
            "diffusion.weighting": WEIGHTINGS.names(), "diffusion.sampler": SAMPLERS.names(),
            "diffusion.backend": BACKENDS, "sample.solver": SOLVERS.names(), "eval.extractor": EXTRACTORS,
            "parallel.strategy": ("auto",) + STRATEGIES, "parallel.ac": AC_MODES, "parallel.precision": PRECISIONS,
            "parallel.compile": COMPILE, "parallel.compile_mode": COMPILE_MODES,
            "model.lora.base_dtype": BASE_DTYPES}


def load_config(preset: str = "default", overrides: list[str] | None = None, resume: bool = False) -> DictConfig:
    """Defaults ← preset ← overrides (config.read_config), then what the run's sources decide and the
    command line does not say: a resumed run's checkpoint (`resumed`), or a fine-tune's pipeline
    scheduler (scheduler_config.adopt); then `validate`."""
    from .pretrained.scheduler_config import adopt

    cfg = read_config(preset, overrides)
    given = {item.split("=", 1)[0].strip() for item in overrides or []}
    resumed_from = resumed(cfg, given) if resume else None
    if resumed_from is None:
        changed = adopt(cfg, given)
        if changed:
            print(f"fasttrain: note: the pretrained pipeline's scheduler sets {', '.join(changed)}", file=sys.stderr)
    validate(cfg, from_checkpoint=resumed_from is not None)
    return cfg


def resumed(cfg: DictConfig, given: set[str] = frozenset()):
    """A resumed run takes from its checkpoint what the checkpoint records and the command line (`given`)
    does not set: the model arguments its model declares `recorded` (a convention older checkpoints
    used, a pretrained architecture: the folder may be gone), a fine-tune's scheduler keys, and
    sample.spacing. Returns the checkpoint's path (None: no checkpoint, nothing taken)."""
    from .checkpoint import latest, read_plain
    from .models import MODELS
    from .pretrained.scheduler_config import KEYS

    path = latest(cfg.run_dir)
    if path is None:
        return None
    saved = read_plain(path, mmap=True)["config"]
    model, args = saved.get("model") or {}, plain(cfg.model.args)
    theirs = model.get("args") or {}
    if model.get("name") == cfg.model.name and cfg.model.name in MODELS:
        for key in MODELS.get(cfg.model.name).recorded:
            if key not in theirs:
                continue
            value, mine = theirs[key], args.get(key)
            if isinstance(value, dict) and isinstance(mine, dict):  # the user's keys over the recorded ones
                args[key] = {**value, **mine}
            elif mine is None and f"model.args.{key}" not in given:
                args[key] = value
        cfg.model.args = args
    recorded = OmegaConf.create(saved)
    for key in KEYS if theirs.get("pretrained") else ("sample.spacing",):  # KEYS hold sample.spacing too
        value = OmegaConf.select(recorded, key)
        if key not in given and value is not None:
            OmegaConf.update(cfg, key, value)
    return path


class _Key:
    """Turns a component's one-line user error (a bad value, a folder it names) into a ConfigError
    naming the key (a missing extra stays what it is: its message names the extra)."""

    def __init__(self, key: str, cfg=None):
        self.key, self.cfg = key, cfg

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, UserError) and not issubclass(kind, (ConfigError, MissingDependency)):
            value = "" if self.cfg is None else f"{OmegaConf.select(self.cfg, self.key)!r} "
            msg = str(e).replace("unknown argument", "unknown config key")
            if msg.startswith(("unknown config key", "bad value for")):
                raise ConfigError(msg) from None
            named = re.match(r"model\.args\.[\w.]+", msg)  # a model's check names the argument at fault
            if named:
                raise ConfigError(f"bad value for '{named.group()}': {msg}") from None
            raise ConfigError(f"bad value for '{self.key}': {value}({msg})") from None
        return False


def validate(cfg: DictConfig, from_checkpoint: bool = False) -> None:
    """Every choice against its registry, every argument against its component, and the combinations
    that cannot work; one line naming the key. `from_checkpoint` (a resumed run): the weights come
    from its checkpoint, so a pretrained folder is not read (models.weights_from_checkpoint)."""
    from .models import weights_from_checkpoint

    with weights_from_checkpoint() if from_checkpoint else contextlib.nullcontext():
        _validate(cfg)


def _validate(cfg: DictConfig) -> None:
    from .data import data_kind
    from .diffusion import PREDICTIONS, SAMPLERS, WEIGHTINGS, loss_weight, timestep_sampler
    from .diffusion.objective import objective_class
    from .diffusion.schedule import from_config as schedule_of
    from .diffusion.solvers import SOLVERS, check_options
    from .models import MODELS, is_image_model, load_pretrained

    for key, allowed in choices().items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"bad value for '{key}': {value!r} (choose from {', '.join(allowed)})")
    d = cfg.diffusion
    for group, reg, name in (("weighting_args", WEIGHTINGS, d.weighting), ("sampler_args", SAMPLERS, d.sampler)):
        with _Key(f"diffusion.{group}"):
            reg.check_args(name, plain(d[group]), where=f"diffusion.{group}")
    args = plain(cfg.model.args)
    for k in ("in_channels", "image_size", "num_classes", "text", "flow_sigma"):
        if k in args:
            raise ConfigError(f"unknown config key 'model.args.{k}' (the data decide it)")
    with _Key("model.args"):
        MODELS.check_args(cfg.model.name, args, where="model.args")
        complete = MODELS.get(cfg.model.name).complete
        if complete is not None:  # e.g. a pretrained folder's architecture: the checkpoint rebuilds without it
            cfg.model.args = complete(args)
            args = plain(cfg.model.args)
    from .pretrained import lora

    _check_text_encoder(cfg, data_kind(cfg.data.name), args)
    if lora.enabled(cfg):  # the adapter against the network it adapts, before any file is written
        with _Key("model.lora.rank", cfg):
            lora.check_config(cfg)
        import torch

        cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
        if cfg.model.lora.base_dtype == "fp16" and cpu:
            raise ConfigError("bad value for 'model.lora.base_dtype': 'fp16' (needs CUDA: on CPU hold the base in "
                              "bf16 or fp32)")
    elif cfg.model.lora.base_dtype != "auto":
        raise ConfigError(f"bad value for 'model.lora.base_dtype': {cfg.model.lora.base_dtype!r} (it sets the dtype "
                          f"of a LoRA run's frozen base; this run has no adapter (model.lora.rank=0))")
    data = data_kind(cfg.data.name)  # what the data set is: its declared traits (data/kinds.py)
    images = data.traits.images
    if images != is_image_model(cfg.model.name):
        kind = "images" if images else "2-D points"
        raise ConfigError(f"bad value for 'model.name': {cfg.model.name!r} does not take {kind} "
                          f"(data.name={cfg.data.name}; {'use an image model' if images else 'use mlp'})")
    text = MODELS.get(cfg.model.name).text
    if (data.traits.conditioning == "text") != bool(text and text(args)):  # captions need a text-conditioned net
        if data.traits.conditioning == "text":
            raise ConfigError(f"bad value for 'model.name': {cfg.model.name!r} with these model.args is not "
                              f"conditioned on text, and data.name={cfg.data.name} is captioned (use model.name="
                              f"diffusers model.args.class_name=UNet2DConditionModel)")
        raise ConfigError(f"bad value for 'model.args.class_name': {args.get('class_name')!r} is conditioned on "
                          f"text, and data.name={cfg.data.name} has no captions (use captioned data: "
                          f"docs/text-to-image.md)")
    flow = MODELS.get(cfg.model.name).flow
    if flow is not None and flow(args) and (d.schedule != "flow" or d.prediction != "flow"):
        key, value = ("diffusion.schedule", d.schedule) if d.schedule != "flow" else ("diffusion.prediction",
                                                                                       d.prediction)
        raise ConfigError(f"bad value for '{key}': {value!r} ({args.get('class_name')} trains on the flow schedule "
                          f"with flow prediction: diffusion.schedule=flow diffusion.prediction=flow, and SD3's "
                          f"diffusion.flow_shift=3.0; a pretrained pipeline's scheduler sets them)")
    lc = cfg.model.lora
    if lc.init is not None and not lc.rank:
        raise ConfigError(f"bad value for 'model.lora.init': {lc.init!r} (a LoRA file starts an adapter: set "
                          f"model.lora.rank, and model.lora.alpha, to the file's)")
    if lc.init is not None and load_pretrained() and not Path(lc.init).exists():  # a resumed run does not read it
        raise ConfigError(f"bad value for 'model.lora.init': {lc.init!r} (no such file)")
    dyn, dynamic = d.dynamic_shift, MODELS.get(cfg.model.name).dynamic_shift
    if dyn.enabled and not (dynamic is not None and dynamic(args)):
        raise ConfigError(f"bad value for 'diffusion.dynamic_shift.enabled': True (a resolution-dependent shift at "
                          f"sampling is implemented for FluxTransformer2DModel runs, not model.name={cfg.model.name} "
                          f"{args.get('class_name') or ''})".replace(" )", ")"))
    if dyn.max_image_seq_len <= dyn.base_image_seq_len:
        raise ConfigError(f"bad value for 'diffusion.dynamic_shift.max_image_seq_len': {dyn.max_image_seq_len} (it "
                          f"must exceed base_image_seq_len = {dyn.base_image_seq_len})")
    with _Key("data"):
        data.check(cfg.data)  # its own rules (a folder needs data.root, ...), naming the key
    if data.traits.needs_root:
        check_run_dir(cfg)
    from .diffusion import noise_options

    noise_options.check_config(d.noise, images=images)  # the cross-key rules, one line naming the key
    with _Key("diffusion.noise"):
        noise_options.options(d.noise)
    if d.flow_shift != 1.0 and d.schedule != "flow":  # a shift on a VP schedule: named by its own key
        raise ConfigError(f"bad value for 'diffusion.flow_shift': {d.flow_shift!r} (a time shift applies to the flow "
                          f"schedule only, not {d.schedule!r}: set diffusion.schedule=flow or drop it)")
    with _Key("diffusion.T", cfg):
        sched = schedule_of(d)
    with _Key("diffusion.prediction", cfg):
        objective_class(d.prediction).check_config(d, sched, args)
    if cfg.data.prior.root is not None and not objective_class(d.prediction).masked_loss:
        raise ConfigError(f"bad value for 'data.prior.root': {cfg.data.prior.root!r} (the prior's weights ride on the "
                          f"loss op's per-pixel weight, which diffusion.prediction={d.prediction} does not take; use "
                          f"eps, x0, v or flow)")
    if cfg.data.mask != "none" and not objective_class(d.prediction).masked_loss:
        raise ConfigError(f"bad value for 'data.mask': {cfg.data.mask!r} (diffusion.prediction={d.prediction} trains "
                          f"with a loss op that takes no per-pixel weight; the masked loss needs eps, x0, v or flow)")
    with _Key("diffusion.weighting_args"):  # a single prediction's own space; other kinds weight x0-space errors
        loss_weight(d.weighting, sched, d.prediction if d.prediction in PREDICTIONS else "x0",
                    **plain(d.weighting_args))
    with _Key("diffusion.sampler_args"):
        timestep_sampler(d.sampler, sched, **plain(d.sampler_args))
    check_ranges(cfg)
    from .optim.phema import check_config as check_phema

    with _Key("phema.sigma_rels", cfg):
        check_phema(cfg.phema)
    from .generation.evaluate import EvalSettings

    with _Key("eval.extra_extractors", cfg):
        EvalSettings.from_config(cfg)
    from .diffusion.align import check_config as check_align

    with _Key("diffusion.align.encoder", cfg):
        check_align(cfg)  # fills diffusion.align.encoder_dim from the encoder
    s = cfg.sample
    if s.eta is not None and "eta" not in SOLVERS.args(s.solver):
        raise ConfigError(f"bad value for 'sample.eta': {s.eta!r} (solver {s.solver} takes no eta)")
    with _Key("sample.eta", cfg):
        check_options(s.solver, sched, eta=s.eta)
    if data.traits.sized_by_config:  # latents bring their own size, points have none
        with _Key("data.image_size", cfg):
            MODELS.check(cfg.model.name, image_size=cfg.data.image_size, **args)
        if cfg.data.buckets:  # every bucket side must suit the network as well (data/buckets.py)
            from .data.buckets import sides

            with _Key("data.bucket_reso_steps", cfg):
                for side in sides(cfg.data):
                    MODELS.check(cfg.model.name, image_size=side, **args)
        check_memory(cfg)


def _check_text_encoder(cfg: DictConfig, data, args: dict) -> None:
    """Text-encoder LoRA and caption shuffling (pretrained/text_lora.py): what they need of the run, one line
    naming the key."""
    lc, d = cfg.model.lora, cfg.data
    if lc.text_encoder:
        why = None
        if not lc.rank:
            why = "needs model.lora.rank > 0: the text encoders' adapters take the UNet's rank and alpha"
        elif data.traits.conditioning != "text":
            why = f"the text encoders of captioned data are adapted, and data.name={d.name} has no captions"
        elif args.get("class_name") != "UNet2DConditionModel":
            why = (f"text-encoder LoRA is for SD 1.x/2.x and SDXL runs (UNet2DConditionModel), not "
                   f"{args.get('class_name')} (SD3's and Flux's text encoders are not adapted here)")
        elif lc.init is not None:
            why = "model.lora.init reads the UNet's adapter alone; start a text-encoder LoRA run from zero adapters"
        if why:
            raise ConfigError(f"bad value for 'model.lora.text_encoder': True ({why})")
    elif cfg.optim.text_encoder_lr is not None:
        raise ConfigError(f"bad value for 'optim.text_encoder_lr': {cfg.optim.text_encoder_lr} (the text encoders "
                          f"train only with model.lora.text_encoder=true)")
    if d.shuffle_caption and not (lc.text_encoder and lc.rank):
        raise ConfigError("bad value for 'data.shuffle_caption': True (data.shuffle_caption=true needs the text "
                          "encoder run live in every step (each shuffle is a new caption): set model.lora.rank and "
                          "model.lora.text_encoder=true; with cached encodings, write the orderings you want as "
                          "alternative lines of the caption files instead)")
    if d.keep_tokens and not d.shuffle_caption:
        raise ConfigError(f"bad value for 'data.keep_tokens': {d.keep_tokens} (it keeps the leading tags in place "
                          f"while data.shuffle_caption=true shuffles the rest)")


def check_run_dir(cfg: DictConfig) -> None:
    """The run directory apart from the data (paths.py): a run writes checkpoints and figures into its
    directory, and `--restart` moves everything in it aside."""
    from .paths import relation

    why = {"is": "is data.root", "inside": "lies inside data.root (checkpoints and figures would join the data)",
           "holds": "holds data.root (--restart moves everything in a run directory aside, the data too)"}
    rel = relation(cfg.run_dir, cfg.data.root)
    if rel:
        raise ConfigError(f"bad value for 'run_dir': {cfg.run_dir!r} {why[rel]}: choose a run directory beside "
                          f"the data, e.g. runs/NAME")


def check_ranges(cfg: DictConfig) -> None:
    """The ranges that depend on another key (config.py checks each key's own): counts of timesteps at
    most diffusion.T where they are used, AdamW's decay factor (a data kind checks its own sizes)."""
    T = cfg.diffusion.T
    per_t = {"sample.steps": cfg.sample.num > 0, "eval.steps": cfg.eval.num_samples > 0,
             "eval.bpd_timesteps": cfg.eval.bpd, "diagnostics.buckets": cfg.diagnostics.interference_every > 0,
             "diagnostics.loss_cv_buckets": True}  # a prediction kind's own counts: its check_config
    for key, used in per_t.items():
        value = OmegaConf.select(cfg, key)
        if used and value > T:
            raise ConfigError(f"bad value for '{key}': {value!r} (at most diffusion.T = {T})")
    o = cfg.optim
    if o.lr * o.weight_decay >= 1:  # AdamW scales the weights by 1 - lr·wd each step (Loshchilov & Hutter, Alg. 2)
        raise ConfigError(f"bad value for 'optim.weight_decay': {o.weight_decay!r} (AdamW multiplies the "
                          f"weights by 1 - optim.lr × weight_decay each step: with optim.lr={o.lr!r} it must be "
                          f"< {1 / o.lr:g})")


def _memory_bytes(device: str) -> tuple[int, str]:
    """What the training device can hold: GPU memory, or this machine's physical memory."""
    import os

    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "this GPU's"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"


def check_memory(cfg: DictConfig) -> None:
    """Sizes checked before anything is allocated: what certainly has to be in memory at once (the
    built-in data resident on the device; one batch of x0, x_t, the prediction and its gradient in
    fp32) against the device's memory. A lower bound (activations come on top): it refuses sizes that
    cannot fit, in one line, instead of an allocation failure deep inside torch or the OOM killer."""
    from .data import data_kind

    d = cfg.data
    kind = data_kind(d.name)
    per_image = kind.channels(d) * d.image_size**2 * 4
    resident = kind.resident_items(d) * per_image
    need = resident + 4 * d.batch_size * per_image
    have, whose = _memory_bytes(cfg.train.device)
    if need > have:  # the key to change: the image size if a batch of one cannot fit either, else the batch
        one = resident + 4 * per_image
        key, value = ("data.image_size", d.image_size) if one > have else ("data.batch_size", d.batch_size)
        raise ConfigError(f"bad value for '{key}': {value} ({d.name} at {d.image_size}×{d.image_size} "
                          f"with data.batch_size={d.batch_size} needs at least {_size(need)}, more than {whose} "
                          f"{_size(have)})")
