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
    name: str = _f("digits", "the data set: built in (digits, 2-D toys, synthetic Gaussian latents for benchmarks) or a folder")
    root: Optional[str] = _f(None, "image folder or .npy latent folder (class subfolders give labels)")
    backend: str = _f("auto", "loader for folders: auto (DALI where installed) | dali | torch")
    manifest: Optional[str] = _f(None, "manifest from `fasttrain data prepare` (default ROOT/fasttrain-manifest.json)")
    crop: str = _f("center", "center | random crop after resizing the shorter side (image folders)")
    flip: bool = _f(True, "random horizontal flips (image folders)")
    image_size: int = _f(8, "side of the square training images (digits are 8×8 natively)")
    channels: int = _f(3, "image channels for name=folder (1 = grey, 3 = RGB) and name=synthetic")
    batch_size: int = _f(16, "micro-batch per process")
    holdout: int = _f(400, "digits held out from training (for evaluation)")
    num_workers: int = _f(0, "loader workers: DataLoader processes or DALI threads (0 = main process / 1 thread)")


@dataclass
class ModelConfig:
    name: str = _f("unet_tiny", "the network (registry: fasttrain/models)")
    class_conditional: bool = _f(True, "condition on labels (ignored for unlabelled data)")
    label_dropout: float = _f(0.1, "probability of dropping the label (classifier-free guidance)")
    args: Dict[str, Any] = _f({}, "overrides passed to the model factory, e.g. model.args.ch=48")


@dataclass
class MixedConfig:
    heads: List[str] = _f(["eps", "x0", "v"], "prediction heads mixed by the gate (two or more of eps, x0, v; flow on the flow schedule)")
    gate: str = _f("pixel", "pixel (gate channels from the network) | timestep (a learned table of logits per timestep)")
    aux_weight: float = _f(0.1, "weight of each head's own loss in its own space")
    mode: str = _f("gate", "generate from the gated mix (gate) or the head with the lowest running x0 error per timestep (argmin)")
    prior: bool = _f(True, "bias the gate by each head's conditioning (ill-conditioned heads start near weight 0)")
    argmin_buckets: int = _f(20, "timestep buckets for mode=argmin")


@dataclass
class DiffusionConfig:
    schedule: str = _f("linear", "the noise schedule")
    T: int = _f(1000, "number of discrete timesteps")
    zero_terminal_snr: bool = _f(False, "rescale a VP schedule to SNR = 0 at t = T-1 (Lin et al. 2024)")
    prediction: str = _f("eps", "what the network predicts (mixed: several heads and a gate, see diffusion.mixed)")
    weighting: str = _f("min_snr", "loss weighting, defined in x0 space")
    weighting_args: Dict[str, Any] = _f({}, "arguments of the weighting, e.g. diffusion.weighting_args.gamma=5")
    sampler: str = _f("uniform", "timestep sampler")
    sampler_args: Dict[str, Any] = _f({}, "arguments of the sampler, e.g. diffusion.sampler_args.k=5")
    learned_weighting: bool = _f(False, "add an EDM2-style learned per-timestep log-variance")
    stats_every: int = _f(10, "steps between statistics syncs and sampler updates (K)")
    backend: str = _f("auto", "kernel backend: auto (triton on CUDA, native on CPU where built, else torch)")
    mixed: MixedConfig = field(default_factory=MixedConfig)


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "AdamW learning rate")
    betas: List[float] = _f([0.9, 0.999], "AdamW betas")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(200, "linear learning-rate warm-up")
    grad_clip: float = _f(1.0, "clip the gradient norm at this value (0 = off)")
    ema_decay: float = _f(0.999, "EMA decay of the sampling weights")
    ema_warmup: bool = _f(True, "EMA decay min(decay, (1+n)/(10+n)) early in training")
    impl: str = _f("auto", "AdamW: auto (apex FusedAdam on CUDA if installed, else torch's fused AdamW)")


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
    cuda_graph: bool = _f(False, "capture the whole step in one CUDA graph and replay it (one GPU; falls back with a reason)")
    max_nonfinite: int = _f(20, "stop after this many non-finite (skipped) steps in a row (0 = never)")


@dataclass
class SampleConfig:
    num: int = _f(100, "images generated at the end of training")
    steps: int = _f(50, "sampling steps (respaced; at most diffusion.T)")
    solver: str = _f("ddim", "generation solver")
    eta: Optional[float] = _f(None, "DDIM eta (default 0 for ddim, 1 for ddpm)")
    guidance: float = _f(1.0, "classifier-free guidance scale (1 = off)")


@dataclass
class ParallelConfig:
    strategy: str = _f("auto", "data parallelism: auto is fsdp under torchrun, else none")
    ac: str = _f("none", "activation checkpointing per block")
    compile: str = _f("none", "torch.compile scope: each repeated block with fullgraph=True, or the whole forward")
    compile_mode: str = _f("default", "torch.compile mode")
    precision: str = _f("auto", "compute precision of the model (auto: bf16 on CUDA, fp32 on CPU); weights, optimizer, EMA and statistics stay fp32")
    channels_last: bool = _f(False, "channels-last memory format for convolutional models (CUDA UNets)")


@dataclass
class DiagnosticsConfig:
    interference_every: int = _f(500, "steps between cross-timestep interference measurements on a probe batch (0 = off)")
    buckets: int = _f(4, "timestep buckets of the interference matrix")
    probe_size: int = _f(16, "images of the interference probe batch (per rank)")
    loss_cv_buckets: int = _f(10, "timestep buckets of the logged loss coefficient of variation")


@dataclass
class EvalConfig:
    every: int = _f(1000, "steps between evaluations during training (0 = only at the end)")
    num_samples: int = _f(500, "generated images for FID/KID/precision/recall (0 = no sample metrics)")
    steps: int = _f(50, "sampling steps for evaluation")
    extractor: str = _f("auto", "FID features: auto is fasttrain-digits for digits, inception-v3-compat for images")
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
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


def presets() -> dict[str, str]:
    """Preset name → its one-line description (the YAML file's first comment)."""
    out = {}
    for p in sorted(PRESET_DIR.glob("*.yaml")):
        first = p.read_text().splitlines()[0] if p.read_text() else ""
        out[p.stem] = first.lstrip("# ").strip()
    return out


def choices() -> dict[str, tuple[str, ...]]:
    """Every key with a fixed set of values: from the registries, so help and validation agree."""
    from .data import BACKENDS as DATA_BACKENDS
    from .data import DATASETS
    from .diffusion import PREDICTIONS_REGISTRY, SAMPLERS, SCHEDULES, WEIGHTINGS
    from .diffusion.objective import BACKENDS
    from .diffusion.solvers import SOLVERS
    from .evaluate import EXTRACTORS
    from .models import MODELS
    from .parallel import AC_MODES, COMPILE, COMPILE_MODES, STRATEGIES
    from .precision import PRECISIONS

    return {"data.name": DATASETS, "data.backend": DATA_BACKENDS, "data.crop": ("center", "random"),
            "model.name": MODELS.names(), "diffusion.schedule": SCHEDULES,
            "diffusion.prediction": PREDICTIONS_REGISTRY.names() + ("mixed",), "diffusion.weighting": WEIGHTINGS.names(),
            "diffusion.mixed.gate": ("pixel", "timestep"), "diffusion.mixed.mode": ("gate", "argmin"),
            "diffusion.sampler": SAMPLERS.names(), "diffusion.backend": BACKENDS, "sample.solver": SOLVERS.names(),
            "train.device": ("auto", "cpu", "cuda"), "eval.extractor": EXTRACTORS,
            "parallel.strategy": ("auto",) + STRATEGIES, "parallel.ac": AC_MODES, "parallel.precision": PRECISIONS,
            "parallel.compile": COMPILE, "parallel.compile_mode": COMPILE_MODES,
            "optim.impl": ("auto", "torch", "apex")}


def keys(cls=Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every leaf of the config, for --help (choices appended)."""
    rows, ch = [], choices() if not prefix else {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            rows += keys(globals()[f.type] if isinstance(f.type, str) else f.type, prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((prefix + f.name, str(f.type).replace("typing.", ""), default, f.metadata.get("help", "")))
    if not prefix:
        rows = [(k, t, d, h + (f" ({' | '.join(ch[k])})" if k in ch else "")) for k, t, d, h in rows]
    return rows


def _wrap(e: OmegaConfBaseException, what: str) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        return ConfigError(f"unknown config key '{key}' ({what})")
    return ConfigError(f"bad value for '{key}': {msg} ({what})")


def load_config(preset: str = "default", overrides: list[str] | None = None) -> DictConfig:
    """Defaults ← preset YAML (a name in fasttrain/presets or a path) ← key=value overrides."""
    import yaml

    cfg = OmegaConf.structured(Config)
    path = Path(preset) if preset.endswith((".yaml", ".yml")) else PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset '{preset}'; choose from {', '.join(presets())} or give a .yaml path")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"preset {path.name} is not valid YAML{at}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"preset {path.name} must be a mapping of config keys, not a {type(loaded).__name__}")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(loaded), {"preset": path.stem})
    except OmegaConfBaseException as e:
        raise _wrap(e, f"in preset {path.name}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _wrap(e, f"from '{item}'") from None
        except yaml.YAMLError as e:  # the value is parsed as YAML: an unclosed list, a stray colon
            raise ConfigError(f"override '{item}': its value is not valid YAML "
                              f"({str(e).splitlines()[0]})") from None
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _wrap(e, "while resolving") from None
    validate(cfg)
    return cfg


def plain(node) -> dict:
    """A config group as plain Python (lists, not ListConfig): what the registries' signatures take."""
    return OmegaConf.to_container(node, resolve=True)


def _check(cond: bool, key: str, cfg, need: str) -> None:
    if not cond:
        raise ConfigError(f"bad value for '{key}': {OmegaConf.select(cfg, key)!r} ({need})")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def validate(cfg: DictConfig) -> None:
    """Every choice against its registry, every argument against its entry's signature, every number
    against its range, and the combinations that cannot work; one line naming the key."""
    from .data import TOYS
    from .diffusion import SAMPLERS, WEIGHTINGS
    from .diffusion import prediction as P
    from .diffusion import schedule as make_schedule
    from .diffusion.solvers import SOLVERS
    from .models import MODELS, is_image_model

    for key, allowed in choices().items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"bad value for '{key}': {value!r} (choose from {', '.join(allowed)})")
    d = cfg.diffusion
    for group, reg, name in (("weighting_args", WEIGHTINGS, d.weighting), ("sampler_args", SAMPLERS, d.sampler)):
        try:
            reg.check_args(name, plain(d[group]), where=f"diffusion.{group}")
        except ValueError as e:
            raise ConfigError(str(e).replace("unknown argument", "unknown config key")) from None
    args = plain(cfg.model.args)
    for k in ("in_channels", "image_size", "num_classes"):
        if k in args:
            raise ConfigError(f"unknown config key 'model.args.{k}' (the data decide it)")
    try:
        MODELS.check_args(cfg.model.name, args, where="model.args")
    except ValueError as e:
        raise ConfigError(str(e).replace("unknown argument", "unknown config key")) from None
    toy = cfg.data.name in TOYS
    if toy == is_image_model(cfg.model.name):
        kind = "2-D points" if toy else "images"
        raise ConfigError(f"bad value for 'model.name': {cfg.model.name!r} does not take {kind} "
                          f"(data.name={cfg.data.name}; {'use mlp' if toy else 'use an image model'})")
    for key, lo in (("data.batch_size", 1), ("data.image_size", 1), ("diffusion.T", 2), ("diffusion.stats_every", 1),
                    ("train.steps", 1), ("train.grad_accum", 1), ("train.log_every", 1), ("train.ckpt_every", 0),
                    ("train.max_nonfinite", 0), ("optim.warmup_steps", 0), ("sample.num", 0), ("sample.steps", 1),
                    ("eval.every", 0), ("eval.num_samples", 0), ("eval.steps", 1), ("eval.bpd_timesteps", 1),
                    ("eval.bpd_samples", 1), ("data.holdout", 1), ("data.num_workers", 0), ("train.threads", 0),
                    ("diagnostics.interference_every", 0), ("diagnostics.buckets", 2), ("diagnostics.probe_size", 1),
                    ("diagnostics.loss_cv_buckets", 2)):
        _check(OmegaConf.select(cfg, key) >= lo, key, cfg, f"must be >= {lo}")
    o = cfg.optim
    _check(_finite(o.lr) and o.lr > 0, "optim.lr", cfg, "a finite number > 0")
    _check(_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", cfg, "a finite number >= 0")
    _check(len(o.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in o.betas), "optim.betas", cfg, "two numbers in [0, 1)")
    _check(_finite(o.grad_clip) and o.grad_clip >= 0, "optim.grad_clip", cfg, "a finite number >= 0")
    _check(_finite(o.ema_decay) and 0 <= o.ema_decay < 1, "optim.ema_decay", cfg, "must lie in [0, 1)")
    _check(_finite(cfg.model.label_dropout) and 0 <= cfg.model.label_dropout < 1, "model.label_dropout", cfg,
           "must lie in [0, 1)")
    _check(_finite(cfg.sample.guidance), "sample.guidance", cfg, "a finite number")
    _check(cfg.sample.eta is None or (_finite(cfg.sample.eta) and cfg.sample.eta >= 0), "sample.eta", cfg,
           "a finite number >= 0")
    _check(cfg.sample.eta is None or "eta" in SOLVERS.args(cfg.sample.solver), "sample.eta", cfg,
           f"solver {cfg.sample.solver} takes no eta")
    if cfg.data.name in ("folder", "latents"):
        _check(bool(cfg.data.root), "data.root", cfg, f"a folder is needed for data.name={cfg.data.name}")
    if cfg.data.name == "folder":
        _check(cfg.data.channels in (1, 3), "data.channels", cfg, "1 (grey) or 3 (RGB)")
    sched = make_schedule(d.schedule, d.T, d.zero_terminal_snr)
    if d.prediction == "mixed":
        from .diffusion import mixed

        try:
            mixed.check_heads(list(d.mixed.heads), sched)
        except ValueError as e:
            raise ConfigError(f"bad value for 'diffusion.mixed.heads': {list(d.mixed.heads)} ({e})") from None
        _check(_finite(d.mixed.aux_weight) and d.mixed.aux_weight >= 0, "diffusion.mixed.aux_weight", cfg, "a finite number >= 0")
        _check(1 <= d.mixed.argmin_buckets <= d.T, "diffusion.mixed.argmin_buckets", cfg, "in [1, diffusion.T]")
        if "out_channels" in cfg.model.args:
            raise ConfigError("bad value for 'model.args.out_channels': a mixed prediction sets the output width itself")
    elif bool((P.conditioning(d.prediction, sched) < 1e-6).any()):
        raise ConfigError(f"bad value for 'diffusion.prediction': {d.prediction!r} cannot be sampled on this schedule "
                          f"(SNR = 0 at t = T-1 makes x̂0 = (x - σ·ε̂)/α undefined); use v, x0 or flow")
    if getattr(SOLVERS.get(cfg.sample.solver), "requires_flow", False) and sched.is_vp:
        raise ConfigError(f"bad value for 'sample.solver': {cfg.sample.solver!r} needs diffusion.schedule=flow")
    if cfg.data.name in ("digits", "folder", "synthetic"):  # latents bring their own size
        _check_image_size(cfg)


def _check_image_size(cfg) -> None:
    """The cheap structural checks a model would otherwise fail on deep inside its constructor."""
    from .models import MODELS

    defaults = MODELS.args(cfg.model.name)
    size = cfg.data.image_size
    if "ch_mult" in defaults:  # UNets halve the resolution len(ch_mult) - 1 times
        mult = cfg.model.args.get("ch_mult", defaults["ch_mult"])
        f = 2 ** (len(mult) - 1)
        _check(size % f == 0, "data.image_size", cfg, f"{cfg.model.name} halves it {len(mult) - 1} times: a multiple of {f}")
    if "patch" in defaults:
        p = cfg.model.args.get("patch", defaults["patch"])
        _check(size % p == 0, "data.image_size", cfg, f"{cfg.model.name} cuts {p}×{p} patches: a multiple of {p}")
