"""`fasttrain export RUN --to diffusers OUT`: a trained run as a diffusers pipeline folder.

    OUT/model_index.json      names FasttrainPipeline (OUT/pipeline.py) and its components, and holds
                              the `fasttrain` settings the pipeline samples with
    OUT/transformer/ or unet/ the network with the EMA weights (`--raw`: the raw ones), converted
                              weight for weight (convert.py): DiTTransformer2DModel or UNet2DModel
    OUT/scheduler/            the run's betas (`trained_betas`) and prediction type: diffusers'
                              first-order DPM-Solver++, which is DDIM (η = 0), on fasttrain's step
                              spacing; rectified flow: FlowMatchEulerDiscreteScheduler
    OUT/vae/                  latent runs: the VAE that decodes them
    OUT/pipeline.py           export_pipeline.py, which reproduces fasttrain's sampling

    pipe = diffusers.DiffusionPipeline.from_pretrained(OUT, trust_remote_code=True)

Stock pipelines cannot reproduce a fasttrain DiT: DiTTransformer2DModel hard-codes other timestep
frequencies than fasttrain's (convert.py), DiTPipeline hard-codes the null label 1000 and decodes with
`scaling_factor` alone, DDPMPipeline/DDIMPipeline pass no class labels and DDIMScheduler steps to
t − T//n; hence the pipeline file. What cannot be exported is refused with the reason: 2-D point
models, mixed prediction (several heads and a gate: no scheduler consumes them), UNets whose layers
diffusers cannot express (convert.unet_refusal), a DiT with mlp_ratio ≠ 4.

Every export is checked before it is written: on probe inputs (float64, conditional and null labels,
early and late timesteps) the converted network's output must equal the backbone's.
"""
from __future__ import annotations

import copy
import inspect
import json
import shutil
import sys
from pathlib import Path

import torch

from . import optional
from .errors import InvalidInput

FORMATS = ("diffusers",)
PREDICTION_TYPES = {"eps": "epsilon", "v": "v_prediction", "x0": "sample", "flow": "flow_prediction"}
PIPELINE_FILE = Path(__file__).with_name("export_pipeline.py")


def refusal(bundle) -> str | None:
    """Why this run has no diffusers pipeline (None if it has one)."""
    df, spec = bundle.cfg.diffusion, bundle.spec
    if not spec.image_size:
        return "it generates 2-D points; diffusers pipelines generate images"
    if df.prediction not in PREDICTION_TYPES:
        return (f"diffusion.prediction={df.prediction}: its heads and gate have no diffusers scheduler "
                f"(schedulers take one prediction type)")
    if (df.schedule == "flow") != (df.prediction == "flow"):
        return (f"prediction {df.prediction} on the {df.schedule} schedule: the export takes VP schedules with eps, v "
                f"or x0, and the flow schedule with flow prediction")
    return None


def scheduler_for(bundle):
    """(scheduler, note or None) with the run's schedule and prediction type."""
    diffusers = optional.diffusers("export --to diffusers")
    df, s = bundle.cfg.diffusion, bundle.schedule.to("cpu")
    if df.schedule == "flow":  # its training sigmas are fasttrain's (t+1)/T grid (export_pipeline.py)
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=s.T, shift=1.0), None
    abar = s.alpha.double() ** 2
    note = None
    if float(abar[-1]) < 2.0**-24:  # zero terminal SNR: DPM-Solver's log-SNR must be finite
        abar[-1] = 2.0**-24
        note = ("zero terminal SNR: the scheduler's last ᾱ is 2^-24, not 0 (DPM-Solver needs a finite log-SNR), "
                "so the first step differs slightly from fasttrain's")
    betas = (1 - abar / torch.cat([abar.new_ones(1), abar[:-1]])).tolist()  # cumprod(1 - β) = ᾱ
    clip = 1.0 if bundle.spec.is_images else None
    sched = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=s.T, trained_betas=betas, prediction_type=PREDICTION_TYPES[df.prediction],
        solver_order=1, algorithm_type="dpmsolver++", final_sigmas_type="zero", lower_order_final=True,
        thresholding=clip is not None, sample_max_value=1.0, timestep_spacing="linspace")
    return sched, note


def _diffusers_labels(y, t, num_classes: int, null: int | None):
    if null is None:
        return None
    if y is None:
        return torch.full_like(t, null)
    return torch.where(y == num_classes, torch.full_like(y, null), y)


@torch.no_grad()
def verify(backbone, model, num_classes: int, null: int | None, shape, T: int) -> float:
    """Max |Δ| between the backbone and the converted model on probe inputs, both in float64; raises
    if they differ beyond rounding (a conversion bug, not a user error)."""
    ref, hf = copy.deepcopy(backbone).double().eval(), copy.deepcopy(model).double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn((4,) + tuple(shape), generator=g, dtype=torch.float64)
    t = torch.tensor([0, T // 3, 2 * T // 3, T - 1])
    y = torch.tensor([0, num_classes, num_classes - 1, num_classes]) if num_classes else None
    a = ref(x, t, y)
    b = hf(x, t, class_labels=_diffusers_labels(y, t, num_classes, null)).sample[:, :a.shape[1]]
    err = float((a - b).abs().max())
    if not err <= 1e-6 * max(1.0, float(a.abs().max())):
        raise RuntimeError(f"the converted network differs from fasttrain's by {err:.3g} (a conversion bug)")
    return err


def settings(bundle, frequencies: str, null: int | None) -> dict:
    """The `fasttrain` entry of model_index.json: what FasttrainPipeline samples with."""
    cfg, spec = bundle.cfg, bundle.spec
    out = {"T": bundle.schedule.T, "schedule": cfg.diffusion.schedule, "prediction": cfg.diffusion.prediction,
           "channels": spec.channels, "image_size": spec.image_size, "num_classes": spec.num_classes,
           "null_label": null, "clip": 1.0 if spec.is_images else None, "timestep_frequencies": frequencies,
           "spacing": "respaced", "steps": int(cfg.sample.steps), "guidance": float(cfg.sample.guidance),
           "run_step": bundle.step}
    if spec.latents:
        out.update(latent_shift=list(spec.latents["shift"]), latent_scale=list(spec.latents["scale"]),
                   latent_norm=spec.latents["norm"])
    return out


def export_diffusers(run: str, out: str, vae: str | None = None, ema: bool = True) -> dict:
    """Write the pipeline folder `out` for the run's checkpoint; returns a summary."""
    from .bundle import ModelBundle
    from .config import plain
    from .convert import to_diffusers
    from .models import MODELS

    diffusers = optional.diffusers("export --to diffusers")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidInput(f"export folder {out} already exists and is not empty (nothing was written)")
    b = ModelBundle.load(run, device="cpu", vae=vae)
    why = refusal(b)
    if why:
        raise InvalidInput(f"{run} cannot be exported to diffusers: {why}")
    name = b.cfg.model.name
    args = {k: v for k, v in MODELS.args(name).items() if v is not inspect.Parameter.empty}
    args.update(plain(b.cfg.model.args))
    with b.averaged(ema) as net:
        component, model, frequencies, null = to_diffusers(net.net, args)
        err = verify(net.net, model, b.spec.num_classes, null, b.spec.shape, b.schedule.T)
    sched, note = scheduler_for(b)
    codec = b.codec if b.decodes else None
    out.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(out / component)
        sched.save_pretrained(out / "scheduler")
        if codec is not None:
            codec.vae.save_pretrained(out / "vae")
        index = {"_class_name": ["pipeline", "FasttrainPipeline"], "_diffusers_version": diffusers.__version__,
                 "scheduler": ["diffusers", type(sched).__name__], "transformer": [None, None], "unet": [None, None],
                 "vae": ["diffusers", type(codec.vae).__name__] if codec is not None else [None, None],
                 "fasttrain": settings(b, frequencies, null)}
        index[component] = ["diffusers", type(model).__name__]
        (out / "model_index.json").write_text(json.dumps(index, indent=2))
        shutil.copyfile(PIPELINE_FILE, out / "pipeline.py")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-written export
        raise
    if note:
        print(f"fasttrain: note: {note}", file=sys.stderr)
    return {"out": str(out), "network": type(model).__name__, "scheduler": type(sched).__name__,
            "vae": codec is not None, "max_abs_diff": err, "step": b.step, "weights": "ema" if ema else "raw"}
