"""Typed run configuration, the ground floor: dataclasses with commented defaults and their own value
ranges (OmegaConf structured configs), named YAML presets in `fasttrain/presets/`, `key=value`
overrides. Every error is one line naming the key. This module imports nothing of fasttrain but its
errors: what the registered components accept (choices, their arguments, combinations) is checked by
configure.py, where each component validates its own part."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"


# Counts of steps and periods: far beyond any run, and far below where the 64-bit counters they feed
# (images = steps × batch) would overflow.
STEPS = 2**40
# Image sides in pixels (bucket sides): beyond any training resolution (SDXL's and SD3's are 1024); a
# bucket table of larger sides would be sized for images no VAE or network here takes.
SIDE = 2**14
# Threads and workers: more than any machine has cores (cpu.py caps threads at this machine's); a C int
# beyond it was "Overflow when unpacking long" (train.threads=9999999999).
THREADS = 4096


def _f(default, help: str, *, min=None, above=None, below=None, max=None, finite: bool = False, choices=None,
       usual=None, min_items: int | None = None):
    """A field with its help line and the values it accepts: `min` and `max` (inclusive), `above` and
    `below` (exclusive), `finite`, `choices` (a fixed set; registry choices are configure.py's). For a
    list the bounds hold for every element; None is always accepted where the type is Optional.
    `usual` (lo, hi): the range practitioners use; a value outside it is accepted, and named when a
    run stops for non-finite steps (`unusual`). `min_items`: a list of at least this many non-empty
    strings (e.g. LoRA's target modules)."""
    bounded = min is not None or above is not None or below is not None or max is not None
    meta = {"help": help, "min": min, "above": above, "below": below, "max": max, "finite": finite or bounded,
            "choices": choices, "usual": usual, "min_items": min_items}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class PriorConfig:
    root: Optional[str] = _f(None, "DreamBooth prior preservation (diffusers --with_prior_preservation "
                             "--class_data_dir, sd-scripts --reg_data_dir): the class latents (`data prepare "
                             "CLASS_IMAGES --vae PIPE --text-encoders PIPE --prompt CLASS_PROMPT`; class images from "
                             "the base: `fasttrain data class-images`); each batch is data.batch_size instance latents "
                             "followed by as many class latents (data.name=captioned_latents); None = off")
    weight: float = _f(1.0, "prior_loss_weight: the loss is mse(instance half) + weight · mse(class half), as "
                       "diffusers' train_dreambooth*.py (sd-scripts --prior_loss_weight)", min=0, max=1e3,
                       usual=(0, 2))
    num_images: Optional[int] = _f(None, "train on the first num_images class latents only (diffusers "
                                   "--num_class_images: min(the folder's, num_images)); None: all", min=1)


@dataclass
class DataConfig:
    name: str = _f("digits",
                   "the data set: built in (digits, 2-D toys, synthetic Gaussian latents for benchmarks) or a folder")
    root: Optional[str] = _f(None, "image folder or .npy latent folder (class subfolders give labels)")
    backend: str = _f("auto", "loader for folders: auto (DALI where installed) | dali | torch")
    manifest: Optional[str] = _f(None, "manifest from `fasttrain data prepare` (default ROOT/fasttrain-manifest.json)")
    crop: str = _f("center", "center | random crop after resizing the shorter side (image folders)",
                   choices=("center", "random"))
    flip: bool = _f(True, "random horizontal flips (image folders)")
    image_size: int = _f(8, "side of the square training images (digits are 8×8 natively)", min=1)
    channels: int = _f(3, "image channels for name=folder (1 = grey, 3 = RGB) and name=synthetic", min=1)
    latent_norm: str = _f("auto", "latents: vae (the VAE's scaling/shift factors) | channel (per-channel mean/std) "
                          "| none | auto (vae where the folder records a VAE)",
                          choices=("auto", "vae", "channel", "none"))
    buckets: bool = _f(False, "aspect-ratio buckets for image folders (sd-scripts' semantics; data.image_size is the "
                       "base side: buckets keep about its area)")
    min_bucket_reso: int = _f(256, "smallest bucket side (data.buckets; at most data.max_bucket_reso)", min=1,
                              max=SIDE)
    max_bucket_reso: int = _f(1024, "largest bucket side (data.buckets)", min=1, max=SIDE)
    bucket_reso_steps: int = _f(64, "bucket sides are multiples of this (data.buckets; at most "
                                "data.max_bucket_reso)", min=1, max=SIDE)
    skip_bad_latents: bool = _f(False, "latent folders: train on the folder's one layout, leaving out the files "
                                "`data prepare` names (another shape, rank or dtype; NaN/Inf; unreadable); off: "
                                "such a folder is refused before training")
    shuffle_buffer: int = _f(1000, "samples in the seeded shuffle buffer of a shard stream (name=shards; each "
                             "is held undecoded in memory)", min=1, max=1_000_000)
    batch_size: int = _f(16, "micro-batch per process", min=1, max=2**24)
    holdout: int = _f(400, "digits held out from training (for evaluation)", min=1)
    num_workers: int = _f(0, "loader workers: DataLoader processes or DALI threads (0 = main process / 1 thread; "
                          "more than the machine's cores: a warning)", min=0, max=THREADS)
    caption_dropout: float = _f(0.1, "captioned data: probability of training on the empty prompt instead of the "
                                "caption (classifier-free guidance; diffusers --proportion_empty_prompts, "
                                "sd-scripts --caption_dropout_rate)", min=0, max=1)
    shuffle_caption: bool = _f(False, "shuffle each caption's comma-separated tags every time it is drawn (sd-scripts "
                               "--shuffle_caption, process_caption); needs the text encoders run live in the step "
                               "(model.lora.text_encoder=true); seeded like the caption draw")
    keep_tokens: int = _f(0, "with shuffle_caption: the leading tags kept in place (sd-scripts --keep_tokens)", min=0,
                          max=1000)
    mask: str = _f("none", "loss mask per image (sd-scripts --masked_loss): alpha (the image's alpha channel, "
                   "--alpha_mask) | file (a grayscale NAME.mask.png beside it, white = train) | none; image folders, "
                   "and latents prepared with `data prepare --vae --mask`", choices=("none", "alpha", "file"))
    prior: PriorConfig = field(default_factory=PriorConfig)


@dataclass
class LoraConfig:
    rank: int = _f(0, "LoRA rank through peft (0: off, the whole network trains; sd-scripts --network_dim, diffusers "
                   "--rank; at most the smallest width of the layers it adapts); diffusers backbones only "
                   "(fasttrain/pretrained/lora.py)", min=0, max=4096)
    alpha: Optional[float] = _f(None, "LoRA alpha: the update is scaled by alpha / rank (None: the rank, as diffusers' "
                                "LoRA scripts; sd-scripts --network_alpha)", above=0, max=1e6)
    dropout: float = _f(0.0, "dropout on the LoRA branch's input (peft lora_dropout)", min=0, below=1)
    target_modules: List[str] = _f(["to_k", "to_q", "to_v", "to_out.0"],
                                   "module names the adapters wrap (default: the attention projections, as diffusers' "
                                   "LoRA scripts)", min_items=1)
    init: Optional[str] = _f(None, "start the adapter from this LoRA file: diffusers' pytorch_lora_weights.safetensors "
                             "or a kohya/webui .safetensors (lora_unet_… keys with .alpha); its rank, alpha and "
                             "adapted modules must be this config's (sd-scripts --network_weights)")
    text_encoder: bool = _f(False, "LoRA on the CLIP text encoders too (SD 1.x/2.x: text_encoder; SDXL: both), with "
                            "model.lora.rank and alpha; the encoders then run in the step on the captions' tokens "
                            "(diffusers --train_text_encoder, sd-scripts without --network_train_unet_only; "
                            "fasttrain/pretrained/text_lora.py)")
    text_encoder_targets: List[str] = _f(["q_proj", "k_proj", "v_proj", "out_proj"],
                                         "the text encoders' modules the adapters wrap (diffusers' DreamBooth LoRA "
                                         "scripts: the attention projections)", min_items=1)
    base_dtype: str = _f("auto", "dtype the frozen base is held in while training: auto is bf16 on CUDA (as "
                         "diffusers' LoRA scripts cast the frozen UNet to the mixed-precision dtype), fp32 on CPU; the "
                         "adapter, its optimizer state, EMA and checkpoints stay fp32; sampling and export read "
                         "the base in fp32", choices=("auto", "fp32", "bf16", "fp16"))


@dataclass
class ModelConfig:
    name: str = _f("unet_tiny", "the network (registry: fasttrain/models)")
    class_conditional: bool = _f(True, "condition on labels (ignored for unlabelled data)")
    label_dropout: float = _f(0.1, "probability of dropping the label (classifier-free guidance)", min=0, below=1)
    args: Dict[str, Any] = _f({}, "overrides passed to the model factory, e.g. model.args.ch=48")
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class MixedConfig:
    heads: List[str] = _f(["eps", "x0", "v"],
                          "prediction heads mixed by the gate (two or more of eps, x0, v; flow on the flow schedule)")
    gate: str = _f("pixel",
                   "pixel (gate channels from the network) | timestep (a learned table of logits per timestep)",
                   choices=("pixel", "timestep"))
    aux_weight: float = _f(0.1, "weight of each head's own loss in its own space", min=0, max=1e3, usual=(0, 1))
    mode: str = _f("gate", "generate from the gated mix (gate) or the head with the lowest running x0 error per "
                   "timestep (argmin)",
                   choices=("gate", "argmin"))
    prior: bool = _f(True, "bias the gate by each head's conditioning (ill-conditioned heads start near weight 0)")
    argmin_buckets: int = _f(20, "timestep buckets for mode=argmin (at most diffusion.T)", min=1)


@dataclass
class NoiseConfig:
    offset: float = _f(0.0, "noise offset c: ε + c·n, n ~ N(0, 1) per sample and channel (diffusers --noise_offset, "
                       "sd-scripts noise_offset; 0 = off)", min=0, max=1, usual=(0, 0.2))
    offset_random_strength: bool = _f(False, "offset c·u, u ~ U[0, 1) once per batch (sd-scripts "
                                      "noise_offset_random_strength)")
    adaptive_offset: float = _f(0.0, "add this × |mean over pixels of x0| to the offset per sample and channel, "
                                "clamped at 0 (sd-scripts adaptive_noise_scale; needs offset; 0 = off)", min=-1, max=1,
                                usual=(-0.1, 0.1))
    pyramid_iterations: int = _f(0, "pyramid (multi-resolution) noise levels (sd-scripts multires_noise_iterations; "
                                 "0 = off)", min=0, below=17)
    pyramid_discount: float = _f(0.3, "weight discount^i of pyramid level i (sd-scripts multires_noise_discount)",
                                 min=0, max=1, usual=(0.1, 0.9))
    perturbation: float = _f(0.0, "input perturbation γ: x_t from ε + γ·ξ, the target keeps ε (Ning et al. 2023; "
                             "diffusers --input_perturbation, sd-scripts ip_noise_gamma; 0 = off)", min=0, max=1,
                             usual=(0, 0.2))
    perturbation_random_strength: bool = _f(False, "γ·u, u ~ U[0, 1) once per batch (sd-scripts "
                                            "ip_noise_gamma_random_strength)")
    immiscible: str = _f("none", "immiscible noise (Li et al. 2024): assignment (batch linear assignment, L2 "
                         "distance) or knn (nearest of k fresh draws per image)", choices=("none", "assignment", "knn"))
    immiscible_k: int = _f(64, "knn candidates per image (official: 64 for Stable Diffusion, 4 for flow matching)",
                           min=1, max=4096)


@dataclass
class LossConfig:
    type: str = _f("l2", "per-element loss: l2 | l1 | huber 2c(√(d²+c²)−c) and smooth_l1 2(√(d²+c²)−c) (sd-scripts, "
                   "diffusers) | pseudo_huber √(d²+c²)−c (Charbonnier; diffusers LCM)",
                   choices=("l2", "l1", "huber", "smooth_l1", "pseudo_huber"))
    huber_c: float = _f(0.1, "threshold c of the Huber family (sd-scripts and diffusers: 0.1; LCM: 0.001)", above=0,
                        max=10, usual=(1e-4, 1))
    huber_scale: float = _f(1.0, "scale of c for the constant and exponential schedules (sd-scripts huber_scale)",
                            above=0, max=100, usual=(0.1, 10))
    huber_schedule: str = _f("snr", "c(t): constant | exponential (huber_c^(t/T)) | snr ((1-c)/(1+σ/α)² + c) "
                             "(sd-scripts and diffusers; default snr)", choices=("constant", "exponential", "snr"))


@dataclass
class DynamicShiftConfig:
    enabled: bool = _f(False, "sample with the resolution-dependent flow shift of a FlowMatchEulerDiscreteScheduler "
                       "with use_dynamic_shifting (FLUX.1-dev): shift exp(mu) (or mu, type linear), mu linear in the "
                       "packed image tokens from base_shift at base_image_seq_len to max_shift at max_image_seq_len "
                       "(FluxPipeline); training keeps diffusion.flow_shift (1.0, as diffusers' Flux script); a "
                       "pipeline's scheduler sets these keys")
    # |mu| <= 10: shifts from e^-10 to e^10 (FLUX.1-dev: 0.5 and 1.15); a wider mu only saturates the schedule
    base_shift: float = _f(0.5, "mu at base_image_seq_len tokens", min=-10, max=10)
    max_shift: float = _f(1.15, "mu at max_image_seq_len tokens", min=-10, max=10)
    base_image_seq_len: int = _f(256, "image tokens where mu is base_shift", min=1)
    max_image_seq_len: int = _f(4096, "image tokens where mu is max_shift", min=2)
    time_shift_type: str = _f("exponential", "exponential: shift exp(mu) | linear: shift mu (the scheduler's "
                              "time_shift_type)", choices=("exponential", "linear"))


@dataclass
class AlignConfig:
    encoder: Optional[str] = _f(None, "representation alignment (REPA, Yu et al. 2024): the frozen encoder an "
                                "intermediate block is aligned to: a local transformers model folder (AutoModel: "
                                "DINOv2 and alike) or module:function returning an nn.Module images [B,C,H,W] in "
                                "[-1,1] → patch features [B,N,D] (digits: "
                                "fasttrain.pretrained.digits_encoder:encoder); None = off (docs/strategies.md)")
    depth: int = _f(8, "the block whose output is aligned: the d-th of the network's blocks, from 1 (DiT: its "
                    "transformer blocks; UNet: its stages, down, mid, up; diffusers UNets: down, mid and up blocks); "
                    "REPA: 8 of SiT-XL/2's 28", min=1, max=4096)
    weight: float = _f(0.5, "λ: the alignment loss's weight, added to the diffusion loss (REPA --proj-coeff)", min=0,
                       max=1e3, usual=(0, 2))
    projector_dim: int = _f(2048, "hidden width of the MLP head block → encoder features (REPA --projector-dim)",
                            min=1, max=2**20)
    encoder_size: Optional[int] = _f(None, "model folders: the side images are resized to for the encoder (default: "
                                     "its processor's crop size, else its config's image_size)", min=1)
    encoder_dim: Optional[int] = _f(None, "the encoder's feature width: filled in from the encoder when a run is "
                                    "configured (the head is built to it; a bundle rebuilds it without the encoder)",
                                    min=1)
    targets: str = _f("auto", "the encoder's targets: auto (computed once per image and kept on the device for "
                      "resident data, which has no augmentation; else in the step) | step (always in the step)",
                      choices=("auto", "step"))


@dataclass
class DiffusionConfig:
    schedule: str = _f("linear", "the noise schedule")
    T: int = _f(1000, "number of discrete timesteps", min=2, max=100_000)
    zero_terminal_snr: bool = _f(False, "rescale a VP schedule to SNR = 0 at t = T-1 (Lin et al. 2024)")
    flow_shift: float = _f(1.0, "the flow schedule's time shift σ' = shift·σ/(1+(shift-1)·σ) (SD3: 3.0; 1: none)",
                             above=0)
    dynamic_shift: DynamicShiftConfig = field(default_factory=DynamicShiftConfig)
    prediction: str = _f("eps", "what the network predicts (mixed: several heads and a gate, see diffusion.mixed)")
    weighting: str = _f("min_snr", "loss weighting, defined in x0 space")
    weighting_args: Dict[str, Any] = _f({}, "arguments of the weighting, e.g. diffusion.weighting_args.gamma=5")
    sampler: str = _f("uniform", "timestep sampler")
    sampler_args: Dict[str, Any] = _f({}, "arguments of the sampler, e.g. diffusion.sampler_args.k=5")
    learned_weighting: bool = _f(False, "add an EDM2-style learned per-timestep log-variance")
    logvar_layer: str = _f("linear", "its layer: linear (zero-initialised) | edm2 (EDM2's MPConv: random init, "
                           "forced weight normalization)", choices=("linear", "edm2"))
    stats_every: int = _f(10, "steps between statistics syncs and sampler updates (K)", min=1, max=STEPS)
    backend: str = _f("auto", "kernel backend: auto (triton on CUDA, native on CPU where built, else torch)")
    mixed: MixedConfig = field(default_factory=MixedConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    align: AlignConfig = field(default_factory=AlignConfig)


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "AdamW learning rate", above=0, usual=(1e-6, 0.05))
    betas: List[float] = _f([0.9, 0.999], "AdamW betas (two numbers in [0, 1))", min=0, below=1, usual=(0.5, 0.9999))
    weight_decay: float = _f(0.0, "AdamW weight decay (optim.lr × weight_decay < 1)", min=0, usual=(0, 0.1))
    warmup_steps: int = _f(200, "linear learning-rate warm-up", min=0, max=STEPS)
    text_encoder_lr: Optional[float] = _f(None, "learning rate of the text encoders' LoRA (model.lora.text_encoder; "
                                          "None: optim.lr; diffusers and sd-scripts --text_encoder_lr)", above=0,
                                          usual=(1e-7, 0.05))
    grad_clip: float = _f(1.0, "clip the gradient norm at this value (0 = off)", min=0)
    ema_decay: float = _f(0.999, "EMA decay of the sampling weights", min=0, below=1)
    ema_warmup: bool = _f(True, "EMA decay min(decay, (1+n)/(10+n)) early in training")
    impl: str = _f("auto", "AdamW: auto (apex FusedAdam on CUDA if installed, else torch's fused AdamW)",
                   choices=("auto", "torch", "apex"))


@dataclass
class TrainConfig:
    steps: int = _f(5000, "optimizer steps", min=1, max=STEPS)
    grad_accum: int = _f(1, "micro-batches per optimizer step", min=1, max=65536)
    log_every: int = _f(100, "steps between metric lines", min=1, max=STEPS)
    ckpt_every: int = _f(1000, "steps between checkpoints (0 = only at the end)", min=0, max=STEPS)
    seed: int = _f(0, "seed of weights, data order, timesteps and noise", min=0, max=2**63 - 1)
    device: str = _f("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    threads: int = _f(0, "torch CPU threads (0 = auto: 1 for a CPU run, torch's default for a GPU run; more than "
                      "the machine's cores: capped, with a warning)", min=0, max=THREADS)
    progress: bool = _f(True, "show a progress bar")
    plots: bool = _f(True, "draw the run's figures at the end (loss, per-timestep statistics, evaluation curves)")
    cuda_graph: bool = _f(False,
                          "capture the whole step in one CUDA graph and replay it (one GPU; falls back with a reason)")
    max_nonfinite: int = _f(20, "stop after this many non-finite (skipped) steps in a row (0 = never)", min=0,
                            max=STEPS)
    max_nonfinite_frac: float = _f(0.5, "... or when at least this fraction of the last max(100, max_nonfinite) "
                                   "steps were skipped (above 1 = only the run counts)", min=0)


@dataclass
class PhemaConfig:
    every: int = _f(0, "steps between post-hoc EMA snapshots (EDM2 §3: power-function EMA profiles in RUN/phema/, "
                    "also written at the last step; `fasttrain ema RUN --sigma-rel S` rebuilds the EMA of any length "
                    "from them; 0 = off). Disk: profiles × 4 bytes × parameters per snapshot (docs/training.md)",
                    min=0, max=STEPS)
    sigma_rels: List[float] = _f([0.05, 0.10], "σ_rel (the averaging profile's std / the training time) of the "
                                 "profiles tracked (EDM2's two); distinct, each in (0, 0.2887)", above=0, below=0.2887)


@dataclass
class SampleConfig:
    num: int = _f(100, "images generated at the end of training", min=0, max=1_000_000)
    steps: int = _f(50, "sampling steps (at most diffusion.T)", min=1)
    spacing: str = _f("trailing", "which timesteps the steps visit, named as diffusers' timestep_spacing: trailing "
                      "(T-1 down to ~T/steps, then x0) | linspace (T-1 … 0) | leading (0, T//steps, … reversed)",
                      choices=("trailing", "linspace", "leading"))
    solver: str = _f("ddim", "generation solver")
    eta: Optional[float] = _f(None, "DDIM eta (default 0 for ddim, 1 for ddpm; above 1 the DDIM variance has no "
                              "square root)", min=0, max=1)
    guidance: float = _f(1.0, "classifier-free guidance scale (1 = off, 0 = unconditional)", min=0, max=100,
                         usual=(1, 20))
    prompts: List[str] = _f([], "text runs: the prompts of the in-run sample grids (diffusers --validation_prompts; "
                            "default: the data's first captions)", min_items=0)
    negative_prompt: str = _f("", "text runs: the unconditional side of guidance (default the empty prompt)")
    embedded_guidance: Optional[float] = _f(None, "a guidance-distilled Flux transformer's embedded guidance when "
                                            "sampling (FluxPipeline guidance_scale; None: model.args.guidance, the "
                                            "training value)", min=0, max=100)


@dataclass
class ParallelConfig:
    strategy: str = _f("auto", "data parallelism: auto is fsdp under torchrun, else none")
    ac: str = _f("none", "activation checkpointing per block")
    compile: str = _f("none", "torch.compile scope: each repeated block with fullgraph=True, or the whole forward")
    compile_mode: str = _f("default", "torch.compile mode")
    precision: str = _f("auto", "compute precision of the model (auto: bf16 on CUDA, fp32 on CPU); weights, optimizer, "
                        "EMA and statistics stay fp32")
    channels_last: bool = _f(False, "channels-last memory format for convolutional models (UNets: tensor cores on "
                             "CUDA, oneDNN's NHWC kernels on CPU; the default preset sets it)")


@dataclass
class DiagnosticsConfig:
    interference_every: int = _f(500,
                                 "steps between cross-timestep interference measurements on a probe batch (0 = off)",
                                 min=0, max=STEPS)
    buckets: int = _f(4, "timestep buckets of the interference matrix (at most diffusion.T)", min=2)
    probe_size: int = _f(16, "images of the interference probe batch (per rank)", min=1, max=2**16)
    loss_cv_buckets: int = _f(10, "timestep buckets of the logged loss coefficient of variation (at most "
                              "diffusion.T)", min=2)


@dataclass
class EvalConfig:
    every: int = _f(1000, "steps between evaluations during training (0 = only at the end)", min=0, max=STEPS)
    num_samples: int = _f(500, "generated images for FID/KID/precision/recall (0 = no sample metrics)", min=0,
                          max=1_000_000)
    steps: int = _f(50, "sampling steps for evaluation (at most diffusion.T)", min=1)
    extractor: str = _f("auto", "FID features: auto is fasttrain-digits for digits, inception-v3-compat for images")
    weights_path: Optional[str] = _f(None, "local Inception weights for machines that cannot download them")
    extra_extractors: List[str] = _f([], "FID in these extractors' features too, on the same samples (metrics "
                                     "fid_<name>): e.g. [fasttrain-digits-cnn], the second digits evaluator "
                                     "(generation/digits_cnn.py)")
    bpd: bool = _f(True, "negative ELBO in bits/dim on held-out data")
    bpd_samples: int = _f(400, "held-out samples for bits/dim", min=1, max=1_000_000)
    bpd_timesteps: int = _f(50, "timesteps per sample in the bits/dim estimate (stratified; at most diffusion.T)",
                            min=1)
    seed: int = _f(1234, "sampling seed of evaluations (the same seed gives the same noise, so evaluations compare "
                   "networks, not draws)", min=0, max=2**63 - 1)
    at_start: bool = _f(False, "also evaluate the initial network, before the first step (when eval.every > 0)")


@dataclass
class Config:
    preset: str = _f("default", "the preset this run started from")
    run_dir: str = _f("runs/${preset}", "where checkpoints, metrics, samples and plots go")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    phema: PhemaConfig = field(default_factory=PhemaConfig)
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


def keys(cls=Config, prefix: str = "", choices: dict | None = None) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every leaf of the config, for --help; `choices` (key → allowed
    values, configure.py's) are appended to the help."""
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            rows += keys(globals()[f.type] if isinstance(f.type, str) else f.type, prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((prefix + f.name, str(f.type).replace("typing.", ""), default, f.metadata.get("help", "")))
    if choices:
        rows = [(k, t, d, h + (f" ({' | '.join(choices[k])})" if k in choices else "")) for k, t, d, h in rows]
    return rows


def _wrap(e: OmegaConfBaseException, what: str, key_hint: str | None = None) -> ConfigError:
    key = getattr(e, "full_key", None) or key_hint or "?"
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        return ConfigError(f"unknown config key '{key}' ({what})")
    return ConfigError(f"bad value for '{key}': {msg} ({what})")


def _check_shapes(cfg: DictConfig, given, prefix: str = "") -> None:
    """A section of the schema given a plain value (`diffusion.loss=huber`, a preset's `loss: huber`):
    one line naming the section and its keys (OmegaConf's merge error names no key)."""
    if not isinstance(given, dict):
        return
    for k, v in given.items():
        key = f"{prefix}{k}"
        node = OmegaConf.select(cfg, key, default=None) if isinstance(k, str) else None
        if not OmegaConf.is_dict(node):
            continue
        if isinstance(v, dict):
            _check_shapes(cfg, v, key + ".")
            continue
        sub = list(node.keys())
        if dataclasses.is_dataclass(OmegaConf.get_type(node)):
            shown = ", ".join(f"{key}.{n}" for n in sub[:4]) + (", ..." if len(sub) > 4 else "")
            raise ConfigError(f"'{key}' is a section, not a value: set one of its keys ({shown}), "
                              f"e.g. {key}.{sub[0]}={v}")
        raise ConfigError(f"'{key}' is a mapping of named arguments, not a value: set them one by one, "
                          f"e.g. {key}.NAME={v}")


def read_config(preset: str = "default", overrides: list[str] | None = None) -> DictConfig:
    """Defaults ← preset YAML (a name in fasttrain/presets or a path) ← key=value overrides, with the
    types and value ranges of the schema checked (configure.load_config also checks the components)."""
    import yaml

    cfg = OmegaConf.structured(Config)
    path = Path(preset) if preset.endswith((".yaml", ".yml")) else PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset '{preset}'; choose from {', '.join(presets())} or give a .yaml path")
    try:
        loaded = load_yaml(path.read_text(), path.name)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"preset {path.name} is not valid YAML{at}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"preset {path.name} must be a mapping of config keys, not a {type(loaded).__name__}")
    try:
        _check_shapes(cfg, loaded)
    except ConfigError as e:
        raise ConfigError(f"{e} (in preset {path.name})") from None
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(loaded), {"preset": path.stem})
    except OmegaConfBaseException as e:
        raise _wrap(e, f"in preset {path.name}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            given = OmegaConf.from_dotlist([item])
            _check_shapes(cfg, OmegaConf.to_container(given))
            cfg = OmegaConf.merge(cfg, given)
        except OmegaConfBaseException as e:
            raise _wrap(e, f"from '{item}'", item.split("=", 1)[0]) from None
        except yaml.YAMLError as e:  # the value is parsed as YAML: an unclosed list, a stray colon
            raise ConfigError(f"override '{item}': its value is not valid YAML "
                              f"({str(e).splitlines()[0]})") from None
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise _wrap(e, "while resolving") from None
    check_schema(cfg)
    return cfg


MAX_YAML_NODES = 100_000  # a preset is a few hundred values; anything near this is not a config


def load_yaml(text: str, name: str):
    """A preset's YAML, safely: PyYAML's safe loader, refusing (one line) what it would accept silently
    or expand without bound: a key given twice in one mapping (the last one would win), and aliases
    that expand to more than MAX_YAML_NODES values ("billion laughs": a few lines of nested aliases
    are exponentially many values) or refer to themselves."""
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: aliases stay shared, nothing expands
    if root is None:
        return None
    sizes: dict[int, int] = {}

    def expanded(node, path: tuple) -> int:  # values after alias expansion, memoised on shared nodes
        if id(node) in path:
            raise ConfigError(f"preset {name}: an alias refers to itself (line {node.start_mark.line + 1})")
        if id(node) not in sizes:
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for k, _ in node.value:
                    key = k.value if isinstance(k, yaml.ScalarNode) else None
                    if key is not None and key in seen:
                        raise ConfigError(f"preset {name}: key {key!r} is given twice (lines {seen[key] + 1} and "
                                          f"{k.start_mark.line + 1}); keep one")
                    seen[key] = k.start_mark.line
                children = [c for kv in node.value for c in kv]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            total = 1
            for c in children:
                total += expanded(c, path + (id(node),))
                if total > MAX_YAML_NODES:
                    raise ConfigError(f"preset {name}: its aliases expand to more than {MAX_YAML_NODES} values "
                                      f"(refused: nested aliases can grow exponentially)")
            sizes[id(node)] = total
        return sizes[id(node)]

    expanded(root, ())
    return yaml.safe_load(text)


def plain(node) -> dict:
    """A config group as plain Python (lists, not ListConfig): what the registries' signatures take."""
    return OmegaConf.to_container(node, resolve=True)


def _leaves(cls=Config, prefix: str = ""):
    for f in dataclasses.fields(cls):
        t = globals()[f.type] if isinstance(f.type, str) and f.type.endswith("Config") else f.type
        if dataclasses.is_dataclass(t):
            yield from _leaves(t, prefix + f.name + ".")
        else:
            yield prefix + f.name, f.metadata


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def check_schema(cfg: DictConfig) -> None:
    """Every value against the range and choices its field declares; one line naming the key."""
    for key, meta in _leaves():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if meta.get("choices") and value not in meta["choices"]:
            raise ConfigError(f"bad value for '{key}': {value!r} (choose from {', '.join(meta['choices'])})")
        if meta.get("min_items") is not None:
            items = list(value)
            if len(items) < meta["min_items"] or not all(isinstance(v, str) and v.strip() for v in items):
                least = f", at least {meta['min_items']}" if meta["min_items"] else ""
                raise ConfigError(f"bad value for '{key}': {items!r} (a list of non-empty strings{least})")
            continue
        values = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        for v in values:
            need = _need(meta)
            if meta.get("finite") and not _finite(v):
                raise ConfigError(f"bad value for '{key}': {value!r} (a finite number{need})")
            lo, hi, above, below = meta.get("min"), meta.get("max"), meta.get("above"), meta.get("below")
            if ((lo is not None and v < lo) or (hi is not None and v > hi) or (above is not None and v <= above)
                    or (below is not None and v >= below)):
                raise ConfigError(f"bad value for '{key}': {value!r} (must be{need.replace(',', '', 1)})")
    betas = cfg.optim.betas
    if len(betas) != 2:
        raise ConfigError(f"bad value for 'optim.betas': {list(betas)!r} (two numbers in [0, 1))")


def _need(meta) -> str:
    parts = []
    if meta.get("min") is not None:
        parts.append(f">= {meta['min']}")
    if meta.get("above") is not None:
        parts.append(f"> {meta['above']}")
    if meta.get("below") is not None:
        parts.append(f"< {meta['below']}")
    if meta.get("max") is not None:
        parts.append(f"<= {meta['max']}")
    return (", " + " and ".join(parts)) if parts else ""


def unusual(cfg: DictConfig) -> list[str]:
    """"key=value (usually lo to hi)" for every value outside its field's usual range: what a run that
    stopped for non-finite steps names first (train.py)."""
    out = []
    for key, meta in _leaves():
        usual, value = meta.get("usual"), OmegaConf.select(cfg, key)
        if usual is None or value is None:
            continue
        values = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [value]
        if any(not usual[0] <= v <= usual[1] for v in values):
            shown = list(values) if len(values) > 1 else values[0]
            out.append(f"{key}={shown!r} (usually {usual[0]:g} to {usual[1]:g})")
    return out
