"""Typed run configuration: dataclasses with commented defaults (OmegaConf structured configs), named
YAML presets in `fasttrain/presets/`, and `key=value` overrides. Every error is one line naming the key."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A bad configuration key or value; the message is one line that names the key."""


def _f(default, help: str, **kw):
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class DataConfig:
    name: str = _f("digits", "digits | moons | 8gaussians | checkerboard | folder | latents")
    root: Optional[str] = _f(None, "image folder or .npy latent folder (class subfolders give labels)")
    backend: str = _f("auto", "loader for folders: auto (DALI where installed) | dali | torch")
    manifest: Optional[str] = _f(None, "manifest from `fasttrain data prepare` (default ROOT/fasttrain-manifest.json)")
    crop: str = _f("center", "center | random crop after resizing the shorter side (image folders)")
    flip: bool = _f(True, "random horizontal flips (image folders)")
    image_size: int = _f(8, "side of the square training images (digits are 8×8 natively)")
    channels: int = _f(3, "image channels for name=folder (1 = grey)")
    batch_size: int = _f(16, "micro-batch per process")
    holdout: int = _f(400, "digits held out from training (for evaluation)")
    num_workers: int = _f(0, "loader workers: DataLoader processes or DALI threads (0 = main process / 1 thread)")


@dataclass
class ModelConfig:
    name: str = _f("unet_tiny", "unet_tiny | unet_small | dit_tiny | mlp")
    class_conditional: bool = _f(True, "condition on labels (ignored for unlabelled data)")
    label_dropout: float = _f(0.1, "probability of dropping the label (classifier-free guidance)")
    args: Dict[str, Any] = _f({}, "overrides passed to the model factory, e.g. model.args.ch=48")


@dataclass
class DiffusionConfig:
    schedule: str = _f("linear", "linear | scaled_linear | cosine | quad | flow")
    T: int = _f(1000, "number of discrete timesteps")
    zero_terminal_snr: bool = _f(False, "rescale a VP schedule to SNR = 0 at t = T-1 (Lin et al. 2024)")
    prediction: str = _f("eps", "eps | x0 | v | flow")
    weighting: str = _f("min_snr", "simple | constant | snr | min_snr | max_snr | soft_min_snr | p2 | speed | edm | sd3_sigma_sqrt | cosmap")
    weighting_args: Dict[str, Any] = _f({}, "arguments of the weighting, e.g. diffusion.weighting_args.gamma=5")
    sampler: str = _f("uniform", "uniform | stratified | logit_normal | mode | lognormal | speed | loss_second_moment")
    sampler_args: Dict[str, Any] = _f({}, "arguments of the sampler, e.g. diffusion.sampler_args.k=5")
    learned_weighting: bool = _f(False, "add an EDM2-style learned per-timestep log-variance")
    stats_every: int = _f(10, "steps between statistics syncs and sampler updates (K)")
    backend: str = _f("auto", "kernel backend: auto (triton on CUDA, torch on CPU) | triton | interpret | torch")


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "AdamW learning rate")
    betas: List[float] = _f([0.9, 0.999], "AdamW betas")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(200, "linear learning-rate warm-up")
    grad_clip: float = _f(1.0, "clip the gradient norm at this value (0 = off)")
    ema_decay: float = _f(0.999, "EMA decay of the sampling weights")
    ema_warmup: bool = _f(True, "EMA decay min(decay, (1+n)/(10+n)) early in training")
    impl: str = _f("auto", "AdamW: auto (apex FusedAdam on CUDA if installed, else torch fused; foreach on CPU) | torch | apex")


@dataclass
class TrainConfig:
    steps: int = _f(5000, "optimizer steps")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    log_every: int = _f(100, "steps between metric lines")
    ckpt_every: int = _f(1000, "steps between checkpoints (0 = only at the end)")
    seed: int = _f(0, "seed of weights, data order, timesteps and noise")
    device: str = _f("auto", "auto | cpu | cuda")
    threads: int = _f(0, "torch CPU threads (0 = torch's default)")
    progress: bool = _f(True, "show a progress bar")


@dataclass
class SampleConfig:
    num: int = _f(100, "images generated at the end of training")
    steps: int = _f(50, "sampling steps (respaced; at most diffusion.T)")
    method: str = _f("ddim", "ddim | ddpm | heun | flow_euler | flow_heun")
    eta: Optional[float] = _f(None, "DDIM eta (default 0 for ddim, 1 for ddpm)")
    guidance: float = _f(1.0, "classifier-free guidance scale (1 = off)")


@dataclass
class ParallelConfig:
    strategy: str = _f("auto", "auto (fsdp under torchrun, else none) | none | ddp | fsdp")
    ac: str = _f("none", "activation checkpointing per block: none | full | selective")
    compile: bool = _f(False, "torch.compile(fullgraph=True) each block")
    precision: str = _f("fp32", "FSDP parameters: fp32 | bf16 (reductions stay fp32)")


@dataclass
class EvalConfig:
    every: int = _f(1000, "steps between evaluations during training (0 = only at the end)")
    num_samples: int = _f(500, "generated images for FID/KID/precision/recall (0 = no sample metrics)")
    steps: int = _f(50, "sampling steps for evaluation")
    extractor: str = _f("auto", "auto (digits: fasttrain-digits, images: inception-v3-compat) | fasttrain-digits | inception-v3-compat | none")
    weights_path: Optional[str] = _f(None, "local Inception weights for machines that cannot download them")
    bpd: bool = _f(True, "negative ELBO in bits/dim on held-out data")
    bpd_samples: int = _f(400, "held-out samples for bits/dim")
    bpd_timesteps: int = _f(50, "timesteps per sample in the bits/dim estimate (stratified)")


@dataclass
class Config:
    preset: str = _f("default", "the preset this run started from")
    run_dir: str = _f("runs/${preset}", "where checkpoints, metrics, samples and plots go")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def presets() -> dict[str, str]:
    """Preset name → its one-line description (the YAML file's first comment)."""
    out = {}
    for p in sorted(PRESET_DIR.glob("*.yaml")):
        first = p.read_text().splitlines()[0] if p.read_text() else ""
        out[p.stem] = first.lstrip("# ").strip()
    return out


def keys(cls=Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every leaf of the config, for --help."""
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            rows += keys(globals()[f.type] if isinstance(f.type, str) else f.type, prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((prefix + f.name, str(f.type).replace("typing.", ""), default, f.metadata.get("help", "")))
    return rows


def _wrap(e: OmegaConfBaseException, what: str) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        return ConfigError(f"unknown config key '{key}' ({what})")
    return ConfigError(f"bad value for '{key}': {msg} ({what})")


def load_config(preset: str = "default", overrides: list[str] | None = None) -> DictConfig:
    """Defaults ← preset YAML (a name in fasttrain/presets or a path) ← key=value overrides."""
    cfg = OmegaConf.structured(Config)
    path = Path(preset) if preset.endswith((".yaml", ".yml")) else PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset '{preset}'; choose from {', '.join(presets())} or give a .yaml path")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(path), {"preset": path.stem})
    except OmegaConfBaseException as e:
        raise _wrap(e, f"in preset {path.name}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _wrap(e, f"from '{item}'") from None
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _wrap(e, "while resolving") from None
    validate(cfg)
    return cfg


def _choice(cfg, key: str, choices) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        raise ConfigError(f"bad value for '{key}': {value!r} (choose from {', '.join(choices)})")


def _check(cond: bool, key: str, cfg, need: str) -> None:
    if not cond:
        raise ConfigError(f"bad value for '{key}': {OmegaConf.select(cfg, key)!r} ({need})")


def validate(cfg: DictConfig) -> None:
    from .data import BACKENDS as DATA_BACKENDS
    from .data import DATASETS
    from .diffusion import PREDICTIONS, SAMPLERS, SCHEDULES, WEIGHTINGS
    from .evaluate import EXTRACTORS
    from .diffusion.objective import BACKENDS
    from .models import MODELS, model_args
    from .parallel import AC_MODES, PRECISIONS, STRATEGIES
    from .sample import METHODS

    for key, choices in [("data.name", DATASETS), ("data.backend", DATA_BACKENDS), ("data.crop", ("center", "random")),
                         ("model.name", MODELS), ("diffusion.schedule", SCHEDULES), ("diffusion.prediction", PREDICTIONS), ("diffusion.weighting", WEIGHTINGS),
                         ("diffusion.sampler", SAMPLERS), ("diffusion.backend", BACKENDS),
                         ("sample.method", METHODS), ("train.device", ("auto", "cpu", "cuda")),
                         ("eval.extractor", EXTRACTORS), ("parallel.strategy", ("auto",) + STRATEGIES),
                         ("parallel.ac", AC_MODES), ("parallel.precision", PRECISIONS), ("optim.impl", ("auto", "torch", "apex"))]:
        _choice(cfg, key, choices)
    d = cfg.diffusion
    for group, allowed in [("weighting", WEIGHTINGS[d.weighting]), ("sampler", SAMPLERS[d.sampler].ARGS)]:
        for k in d[f"{group}_args"]:
            if k not in allowed:
                raise ConfigError(f"unknown config key 'diffusion.{group}_args.{k}' "
                                  f"({d[group]} takes: {', '.join(allowed) or 'no arguments'})")
    settable = [a for a in model_args(cfg.model.name) if a not in ("in_channels", "image_size", "num_classes")]
    for k in cfg.model.args:
        if k not in settable:  # the data decides channels, size and classes
            raise ConfigError(f"unknown config key 'model.args.{k}' ({cfg.model.name} takes: {', '.join(settable)})")
    _check(cfg.data.batch_size >= 1, "data.batch_size", cfg, "must be >= 1")
    _check(cfg.data.image_size >= 1, "data.image_size", cfg, "must be >= 1")
    _check(d.T >= 2, "diffusion.T", cfg, "must be >= 2")
    _check(d.stats_every >= 1, "diffusion.stats_every", cfg, "must be >= 1")
    _check(cfg.optim.lr > 0, "optim.lr", cfg, "must be > 0")
    _check(len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas), "optim.betas", cfg, "two numbers in [0, 1)")
    _check(cfg.optim.warmup_steps >= 0, "optim.warmup_steps", cfg, "must be >= 0")
    _check(cfg.optim.grad_clip >= 0, "optim.grad_clip", cfg, "must be >= 0")
    _check(0 <= cfg.optim.ema_decay < 1, "optim.ema_decay", cfg, "must lie in [0, 1)")
    _check(0 <= cfg.model.label_dropout < 1, "model.label_dropout", cfg, "must lie in [0, 1)")
    _check(cfg.train.steps >= 1, "train.steps", cfg, "must be >= 1")
    _check(cfg.train.grad_accum >= 1, "train.grad_accum", cfg, "must be >= 1")
    _check(cfg.train.log_every >= 1, "train.log_every", cfg, "must be >= 1")
    _check(cfg.train.ckpt_every >= 0, "train.ckpt_every", cfg, "must be >= 0")
    _check(cfg.sample.num >= 0, "sample.num", cfg, "must be >= 0")
    _check(cfg.sample.steps >= 1, "sample.steps", cfg, "must be >= 1 (more than diffusion.T means T)")
    _check(cfg.eval.every >= 0, "eval.every", cfg, "must be >= 0")
    _check(cfg.eval.num_samples >= 0, "eval.num_samples", cfg, "must be >= 0")
    _check(cfg.eval.steps >= 1, "eval.steps", cfg, "must be >= 1")
    _check(cfg.eval.bpd_timesteps >= 1, "eval.bpd_timesteps", cfg, "must be >= 1")
    _check(cfg.eval.bpd_samples >= 1, "eval.bpd_samples", cfg, "must be >= 1")
    if cfg.data.name in ("folder", "latents"):
        _check(bool(cfg.data.root), "data.root", cfg, f"a folder is needed for data.name={cfg.data.name}")
