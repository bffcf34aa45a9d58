"""A model bundle: everything a trained model needs to generate and be evaluated, and nothing else.

    bundle = ModelBundle.load("runs/default")          # last.pt or a DCP folder; no data, optimizer
    x = bundle.generate(64, labels)                    # or process group needed
    bundle.x0_hat(x_t, t, labels)                      # the network's estimate of x0 (NELBO, probes)

It holds the network (a `Denoiser`: backbone, its output → x̂0 conversion, and the optional learned
log-variance and gate table), its EMA weights, the schedule, the data shape and the classes: no
training objective, timestep sampler or statistics. The trainer builds one from the config and the
data (`ModelBundle.build`) and adds data, objective, optimizer and the step loop; `fasttrain sample`,
`eval` and `report` use `ModelBundle.load` alone, so they work when the training data are gone.
"""
from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf

from . import checkpoint as ckpt
from . import seeds
from .config import plain
from .data.spec import DataSpec
from .diffusion.denoiser import Denoiser
from .diffusion.objective import Objective, objective_class
from .diffusion.samplers import SAMPLERS
from .diffusion.schedule import from_config as schedule_of
from .generation import sampling
from .generation.prompts import RunPrompts
from .models import MODELS, build_model, load_pretrained, weights_from_checkpoint
from .optim.ema import EMA
from .pretrained import lora, text_lora
from .pretrained.vae import LatentDecoder


def build_network(cfg: DictConfig, spec: DataSpec) -> Denoiser:
    """The backbone (as wide as the prediction kind's output) in its Denoiser wrapper, with the
    prediction kind's output → x̂0 conversion."""
    df = cfg.diffusion
    sched = schedule_of(df)
    kind = objective_class(df.prediction)
    args = plain(cfg.model.args)
    width = kind.out_channels(df, spec.channels)
    if width is not None:
        args["out_channels"] = width
    if spec.text is not None:  # the width, length and pooled vector the text-conditioned network takes
        args["text"] = spec.text
    flow = MODELS.get(cfg.model.name).flow
    if flow is not None and flow(args):  # SD3: its time input is the (shifted) flow σ_t·T
        args["flow_sigma"] = sched.sigma
    adapted = lora.enabled(cfg)
    fresh = load_pretrained()  # a new run's network (not one a checkpoint's weights will replace)
    with lora.base_weights() if adapted else contextlib.nullcontext():  # a LoRA checkpoint holds no base weights
        net = build_model(cfg.model.name, in_channels=spec.channels, image_size=spec.image_size,
                          num_classes=spec.num_classes, **args)
    if adapted:
        lora.apply(net, cfg, init=fresh)  # model.lora.init: read only for a new run
    if text_lora.enabled(cfg):  # the adapted text encoders, a module of the backbone
        text_lora.apply(net, cfg, spec)
    out = Denoiser(net, kind.output_head(df, sched), sched, learned_weighting=df.learned_weighting,
                   gate_heads=kind.gate_heads(df), logvar_layer=df.logvar_layer,
                   logvar_seed=seeds.derive(cfg.train.seed, "logvar"))
    if df.align.encoder is not None:  # REPA's head (diffusion/align.py), built after the rest: the same weights
        from .diffusion.align import attach_head

        attach_head(out, df.align, cfg.model.name, (1,) + spec.shape,
                    dict(in_channels=spec.channels, image_size=spec.image_size, num_classes=spec.num_classes, **args))
    return out


def build_objective(cfg: DictConfig, net: Denoiser | None = None, rank: int = 0, stats: bool = True,
                    backend: str | None = None) -> Objective:
    """The training objective of the config's prediction kind; `net` is the network it trains (its
    output head receives what the objective learns for generation, e.g. mixed argmin's choice);
    `backend` the concrete kernel backend decided at set-up (default: the config's choice)."""
    df = cfg.diffusion
    sched = schedule_of(df)
    sampler_args = plain(df.sampler_args)
    if SAMPLERS.get(df.sampler).seeded and "seed" not in sampler_args:  # a learned sampler's own weights
        sampler_args["seed"] = seeds.derive(cfg.train.seed, "policy")
    kind = objective_class(df.prediction)
    return kind.from_config(df, sched, output=None if net is None else net.output,
                            weighting_args=plain(df.weighting_args), sampler_args=sampler_args, stats=stats,
                            learned_weighting=df.learned_weighting, backend=backend or df.backend,
                            seed=seeds.derive(cfg.train.seed, "noise", rank))


class ModelBundle:
    """A trained model's network and EMA weights with its schedule and data spec (module docstring); its
    other jobs are parts of their own: `decoder` (pretrained/vae.LatentDecoder: latents → images), `prompts`
    (generation/prompts.RunPrompts: a text run's encoders and prompt tables; None for other runs) and
    generation (generation/sampling.py, which `generate` and `solver_fn` call)."""

    def __init__(self, cfg: DictConfig, spec: DataSpec, net: Denoiser, ema: EMA, device: torch.device,
                 step: int = 0, images: int = 0, vae: str | None = None):
        self.cfg, self.spec, self.net, self.ema, self.device = cfg, spec, net, ema, torch.device(device)
        self.step, self.images = step, images
        self.schedule = schedule_of(cfg.diffusion).to(self.device)
        self.decoder = LatentDecoder(spec.latents, vae, self.device)  # vae: another folder than the recorded one
        self.prompts = RunPrompts(spec, self.device) if spec.text is not None else None
        if self.prompts is not None:  # text-encoder LoRA (pretrained/text_lora.py): prompts run its adapted encoders
            self.prompts.live = text_lora.live_of(net)

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: DictConfig, spec: DataSpec, device, net: Denoiser | None = None) -> ModelBundle:
        """A fresh network (seeded: the same initial weights on every rank) and its EMA."""
        if net is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seeds.derive(cfg.train.seed, "weights"))
                net = build_network(cfg, spec).to(device)
        o = cfg.optim
        return cls(cfg, spec, net, EMA(net, o.ema_decay, o.ema_warmup), device)

    @classmethod
    def load(cls, path, device=None, vae: str | None = None) -> ModelBundle:
        """From a checkpoint alone (RUN, RUN/last.pt or RUN/dcp): no data, optimizer, process group,
        objective, sampler or statistics. Refuses weights that are not finite. `vae`: the VAE folder
        that decodes a latent run's samples, instead of the one recorded in the checkpoint."""
        from .config import Config

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

        def cfg_of(state):
            try:
                return OmegaConf.merge(OmegaConf.structured(Config), state["config"])
            except Exception as e:  # a config from another version or hand-edited
                raise ckpt.CheckpointError(f"{path}: its config does not fit this version "
                                           f"({type(e).__name__})") from None

        def spec_of(state):
            try:
                return DataSpec(**state["data_spec"])
            except TypeError:
                raise ckpt.CheckpointError(f"{path}: malformed data_spec in the checkpoint") from None

        with weights_from_checkpoint():  # a fine-tuned model's pretrained folder is not read again
            state, model_sd, ema_sd = ckpt.read_bundle_state(path, lambda st: build_network(cfg_of(st), spec_of(st)))
            cfg, spec = cfg_of(state), spec_of(state)
            net = build_network(cfg, spec)
        ckpt.load_weights(net, lora.loadable(state.get("lora"), net, model_sd, path), path)
        net = net.to(device)
        ema = EMA(net, cfg.optim.ema_decay, cfg.optim.ema_warmup)
        ema.load_state_dict(ema_sd)
        named = list(net.named_parameters()) + list(zip(ema.names, ema.shadow))
        bad = [n for n, p in named if not torch.isfinite(p).all()]
        if bad:
            raise ckpt.CheckpointError(f"{path} holds non-finite weights ({bad[0]}); it cannot generate")
        train = ckpt.train_state(state)
        return cls(cfg, spec, net, ema, device, train["step"], train["images"], vae=vae)

    # -- what other parts answer ---------------------------------------------------------------------
    @property
    def decodes(self) -> bool:
        """Samples are VAE latents that this bundle turns into images (the recorded VAE or --vae)."""
        return self.decoder.decodes

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Generated latents → images in [-1, 1] (pretrained/vae.LatentDecoder)."""
        return self.decoder.decode(x)

    # shortcuts to the parts, as callers before the split read them (the exporters)
    codec = property(lambda self: self.decoder.codec, doc="the latent run's VAE (decoder.codec)")
    encoders = property(lambda self: self.prompts.encoders, doc="a text run's encoders (prompts.encoders)")

    def prompt_table(self, prompts: list[str], negative: str = ""):
        """A text run's prompt table (prompts.table)."""
        return self.prompts.table(prompts, negative)

    # -- the network as an estimator ---------------------------------------------------------------
    def x0_hat(self, x_t: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The network's x̂0 at (x_t, t): its output head's conversion (a prediction type's, or a mixed
        prediction's gated mix or argmin head)."""
        return self.net.x0_hat(x_t, t, labels)

    def solver_fn(self, labels: torch.Tensor | None = None, guidance: float = 1.0, clip: float | None = None):
        """`denoise(x_t, t) -> (x̂0, ε̂)` for the solvers, with guidance and clipping (generation/sampling.py)."""
        return sampling.solver_fn(self, labels, guidance, clip)

    @contextlib.contextmanager
    def averaged(self, ema: bool = True):
        """The network in eval mode with the EMA weights swapped in (restored however the block ends)."""
        ctx = self.ema.applied(self.net) if ema else contextlib.nullcontext()
        self.net.eval()
        try:
            with ctx:
                yield self.net
        finally:
            self.net.train()

    def generate(self, n: int, labels: torch.Tensor | None = None, *, seed: int = 0, steps: int = 50,
                 solver: str = "ddim", guidance: float = 1.0, ema: bool = True, progress: bool = False,
                 eta: float | None = None, chunk: int = 1024, spacing: str | None = None,
                 first_image: int | None = None, prompts: list[str] | None = None,
                 negative_prompt: str = "") -> torch.Tensor:
        """n samples in chunks of bounded memory, on the step spacing `spacing` (default: the run's
        sample.spacing). Chunk 0 draws its noise from torch.Generator().manual_seed(seed), as a diffusers
        pipeline given that generator does (solvers.randn), chunk i > 0 from seeds.derive(seed, "eval", i):
        the results do not depend on n or on the device. With `first_image` = j, sample k is image j + k
        of a larger set and draws all its noise from its own generator, torch.Generator().manual_seed(seed +
        j + k), as EDM2's generate_images.py seeds image i with seed i (generation/ranks.py: a set split across
        ranks by image index; a diffusers pipeline given the list of those generators makes the same images).
        Text runs: sample i is of prompts[labels[i]] (labels default to i mod the number of prompts), with
        guidance against `negative_prompt`.
        Under FSDP every rank must call this in lockstep (forwards gather weights)."""
        return sampling.generate(self, n, labels, seed=seed, steps=steps, solver=solver, guidance=guidance, ema=ema,
                                 progress=progress, eta=eta, chunk=chunk, spacing=spacing, first_image=first_image,
                                 prompts=prompts, negative_prompt=negative_prompt)
