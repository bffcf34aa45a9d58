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
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from . import checkpoint as ckpt
from . import seeds
from .config import plain
from .diffusion import schedule as make_schedule
from .diffusion.denoiser import Denoiser
from .diffusion.objective import Objective, objective_class
from .diffusion.samplers import SAMPLERS
from .diffusion.solvers import generate as run_solver
from .errors import CheckpointError, InvalidInput
from .models import MODELS, build_model, weights_from_checkpoint
from .optim.ema import EMA
from .pretrained import lora


@dataclass(frozen=True)
class DataSpec:
    """What the network was trained on: enough to generate and to judge samples without the data."""
    name: str                  # the data kind (data/kinds.py): what it is, its `traits`
    channels: int
    image_size: int | None     # None for 2-D toy data
    num_classes: int           # 0 = unconditional
    label_dropout: float       # > 0: the null label (num_classes) gives the unconditional model
    latents: dict | None = None  # latent data: VAE identity, normalisation, statistics (vae.latent_record)
    class_names: list | None = None  # by label, where the data name them (an export's id2label)
    text: dict | None = None   # captioned data: the text encoders' identity and shapes (data/captioned.py)

    @property
    def decodes(self) -> bool:
        """Latents whose VAE is known: samples are judged as the images it decodes them into."""
        return bool(self.latents and self.latents.get("vae"))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.channels,) + ((self.image_size,) * 2 if self.image_size else ())

    @property
    def traits(self):
        """The data kind's declared traits (data/kinds.py)."""
        from .data import traits

        return traits(self.name)

    @property
    def is_images(self) -> bool:
        """Image pixels in [-1, 1] (clipped when generated, discrete bits/dim, judged as images)."""
        return self.image_size is not None and self.traits.pixels


def build_network(cfg: DictConfig, spec: DataSpec) -> Denoiser:
    """The backbone (as wide as the prediction kind's output) in its Denoiser wrapper, with the
    prediction kind's output → x̂0 conversion."""
    df = cfg.diffusion
    sched = make_schedule(df.schedule, df.T, df.zero_terminal_snr, df.flow_shift)
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
    with lora.base_weights() if adapted else contextlib.nullcontext():  # a LoRA checkpoint holds no base weights
        net = build_model(cfg.model.name, in_channels=spec.channels, image_size=spec.image_size,
                          num_classes=spec.num_classes, **args)
    if adapted:
        lora.apply(net, cfg)
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
    sched = make_schedule(df.schedule, df.T, df.zero_terminal_snr, df.flow_shift)
    sampler_args = plain(df.sampler_args)
    if SAMPLERS.get(df.sampler).seeded and "seed" not in sampler_args:  # a learned sampler's own weights
        sampler_args["seed"] = seeds.derive(cfg.train.seed, "policy")
    kind = objective_class(df.prediction)
    return kind.from_config(df, sched, output=None if net is None else net.output,
                            weighting_args=plain(df.weighting_args), sampler_args=sampler_args, stats=stats,
                            learned_weighting=df.learned_weighting, backend=backend or df.backend,
                            seed=seeds.derive(cfg.train.seed, "noise", rank))


class ModelBundle:
    def __init__(self, cfg: DictConfig, spec: DataSpec, net: Denoiser, ema: EMA, device: torch.device,
                 step: int = 0, images: int = 0, vae: str | None = None):
        self.cfg, self.spec, self.net, self.ema, self.device = cfg, spec, net, ema, torch.device(device)
        self.step, self.images = step, images
        self.vae_folder, self._codec = vae, None  # latent runs: another VAE folder than the recorded one
        self.text_folder, self._encoders = None, None  # text runs: another encoder folder than the recorded one
        self._rows = 0  # text runs: rows of the prompt table being sampled from (its last: the negative prompt)
        df = cfg.diffusion
        self.schedule = make_schedule(df.schedule, df.T, df.zero_terminal_snr, df.flow_shift).to(self.device)
        self._alpha, self._sigma = self.schedule.alpha.float(), self.schedule.sigma.float()

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
        lora.check(state.get("lora"), net, path)
        ckpt.load_weights(net, lora.completed(net, model_sd), path)
        net = net.to(device)
        ema = EMA(net, cfg.optim.ema_decay, cfg.optim.ema_warmup)
        ema.load_state_dict(ema_sd)
        named = list(net.named_parameters()) + list(zip(ema.names, ema.shadow))
        bad = [n for n, p in named if not torch.isfinite(p).all()]
        if bad:
            raise ckpt.CheckpointError(f"{path} holds non-finite weights ({bad[0]}); it cannot generate")
        train = ckpt.train_state(state)
        return cls(cfg, spec, net, ema, device, train["step"], train["images"], vae=vae)

    # -- latent runs: decoding with the VAE ------------------------------------------------------------
    @property
    def codec(self):
        """The latent run's VAE and normalisation (vae.LatentCodec), loaded on first use."""
        if self._codec is None:
            from .pretrained.vae import LatentCodec

            if not self.spec.latents:
                raise InvalidInput("this model was not trained on latents: there is nothing to decode")
            self._codec = LatentCodec.load(self.spec.latents, self.vae_folder, device=self.device)
        return self._codec

    @property
    def decodes(self) -> bool:
        """Samples are VAE latents that this bundle turns into images (the recorded VAE or --vae)."""
        return self.spec.decodes or bool(self.spec.latents and self.vae_folder)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Generated latents → images in [-1, 1] (the normalisation undone, then the VAE's decoder)."""
        return self.codec.decode(x)

    def image_spec(self, images: torch.Tensor) -> DataSpec:
        """The data spec of decoded samples (the data kind `decoded`: images; for grids and image metrics)."""
        s = self.spec
        return DataSpec("decoded", images.shape[1], images.shape[-1], s.num_classes, s.label_dropout)

    def save_decoded(self, path, x: torch.Tensor) -> torch.Tensor:
        """Decode generated latents and save their grid at `path`; returns the images."""
        from . import plots

        images = self.decode(x)
        plots.save_samples(path, images, self.image_spec(images))
        return images

    # -- text runs: prompts ------------------------------------------------------------------------------
    @property
    def encoders(self):
        """The run's text encoders (text_encoders.TextEncoders), loaded on first use from the recorded folder
        (or `text_folder`), checked against the recorded identity."""
        if self._encoders is None:
            from .data import data_kind
            from .pretrained.text_encoders import TextEncoders

            rec = self.spec.text["encoders"]
            folder = self.text_folder or data_kind(self.spec.name).text_encoders(rec)
            enc = TextEncoders.load(folder, rec.get("clip_skip"), self.device)
            enc.check(rec, "this run")
            self._encoders = enc
        return self._encoders

    def prompt_args(self) -> dict:
        """generate()'s prompt arguments from the run's `sample` settings (text runs; {} otherwise)."""
        if self.spec.text is None:
            return {}
        return {"prompts": list(self.cfg.sample.prompts) or None, "negative_prompt": self.cfg.sample.negative_prompt}

    def prompt_table(self, prompts: list[str], negative: str = ""):
        """The encodings of `prompts` and, last, of `negative` (guidance's unconditional side) as a
        TextTable whose rows are the prompts (time_ids: SDXL's micro-conditions of an uncropped image of
        the training size)."""
        from .data.captioned import table_of

        if not prompts:
            raise InvalidInput("a text-conditioned model samples from prompts: give at least one (--prompt)")
        e = self.encoders.encode(list(prompts) + [negative])
        time_ids = None
        if self.spec.text.get("micro"):
            lat = self.spec.latents or {}  # the images' side the latents were encoded at (data prepare --image-size)
            side = lat.get("image_size") or self.spec.image_size * int((lat.get("vae") or {}).get("downsample", 8))
            time_ids = torch.tensor([[side, side, 0, 0, side, side]], dtype=torch.float32).repeat(len(prompts), 1)
        return table_of(e, [1] * len(prompts), time_ids).to(self.device)

    # -- the network as an estimator ---------------------------------------------------------------
    def x0_hat(self, x_t: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The network's x̂0 at (x_t, t): its output head's conversion (a prediction type's, or a mixed
        prediction's gated mix or argmin head)."""
        return self.net.x0_hat(x_t, t, labels)

    def solver_fn(self, labels: torch.Tensor | None = None, guidance: float = 1.0, clip: float | None = None):
        """`denoise(x_t, t) -> (x̂0, ε̂)` for the solvers: classifier-free guidance (Ho & Salimans
        2022, Eq. 6, on x̂0) and clipping of x̂0 to the data range (ε̂ kept consistent with it)."""
        if guidance != guidance or guidance in (float("inf"), float("-inf")):
            raise InvalidInput(f"guidance must be a finite number, got {guidance}")
        null = self.spec.num_classes if self.spec.text is None else None

        def denoise(x_t, t: int):
            tt = torch.full((x_t.shape[0],), t, device=x_t.device, dtype=torch.long)
            if labels is None or guidance == 1.0:
                x0 = self.x0_hat(x_t, tt, labels)
            else:
                # text: the prompt table's last row is the negative prompt (its code `rows + row`, conditioning.py)
                uncond = torch.full_like(labels, null) if null is not None else labels + self._rows
                both = self.x0_hat(torch.cat([x_t, x_t]), torch.cat([tt, tt]), torch.cat([labels, uncond]))
                cond, uncond = both.chunk(2)
                x0 = uncond + guidance * (cond - uncond)
            a, s = self._alpha[t].to(x_t.device), self._sigma[t].to(x_t.device)
            if clip is not None:
                x0 = x0.clamp(-clip, clip)
            return x0, (x_t - a * x0) / s

        return denoise

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

    @torch.no_grad()
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
        j + k), as EDM2's generate_images.py seeds image i with seed i (generation.py: a set split across
        ranks by image index; a diffusers pipeline given the list of those generators makes the same images).
        Text runs: sample i is of prompts[labels[i]] (labels default to i mod the number of prompts), with
        guidance against `negative_prompt`.
        Under FSDP every rank must call this in lockstep (forwards gather weights)."""
        if self.spec.text is not None:
            from .conditioning import using

            table = self.prompt_table(list(prompts or self.spec.text.get("prompts") or []), negative_prompt)
            if labels is None:
                labels = (torch.arange(n, device=self.device) + (first_image or 0)) % (table.rows - 1)
            self._rows = table.rows
            with using(self.net, table):
                return self._generate(n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing,
                              first_image)
        return self._generate(n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing,
                              first_image)

    def _generate(self, n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing, first_image):
        if n < 1:
            raise InvalidInput(f"the number of samples must be >= 1, got {n}")
        if steps < 1:
            raise InvalidInput(f"sampling steps must be >= 1, got {steps}")
        self.net.check_sampling()
        opts = {} if eta is None else {"eta": float(eta)}
        clip = 1.0 if self.spec.is_images else None
        outs = []
        with self.averaged(ema):
            for i, lo in enumerate(range(0, n, chunk)):
                m = min(chunk, n - lo)
                lab = None if labels is None else labels[lo:lo + m].to(self.device)
                if first_image is None:
                    g = torch.Generator().manual_seed(seed if i == 0 else seeds.derive(seed, "eval", i))
                else:
                    g = [torch.Generator().manual_seed(seed + first_image + lo + k) for k in range(m)]
                outs.append(run_solver(self.solver_fn(lab, guidance, clip), self.schedule, (m,) + self.spec.shape,
                                       solver=solver, steps=min(steps, self.schedule.T), generator=g,
                                       device=self.device, progress=progress,
                                       spacing_kind=spacing or self.cfg.sample.spacing, **opts))
        x = torch.cat(outs)
        if not bool(torch.isfinite(x).all()):
            raise CheckpointError(f"the samples are not finite: the weights of step {self.step} are broken "
                             f"(resume from an earlier checkpoint)")
        return x
