"""`fasttrain export RUN --to diffusers OUT`: a trained run as a diffusers pipeline folder.

    OUT/model_index.json      the pipeline class and its components: a stock pipeline where one can
                              drive the run (PIPELINES below), else FasttrainPipeline (OUT/pipeline.py)
    OUT/transformer/ or unet/ the network with the EMA weights (`--raw`: the raw ones), converted
                              weight for weight (convert.py): DiTTransformer2DModel or UNet2DModel
    OUT/scheduler/            the run's schedule and prediction type as a stock scheduler reads them
                              (scheduler_config.py): DDIMScheduler, or FlowMatchEulerDiscreteScheduler
    OUT/vae/                  latent runs: the VAE that decodes them
    OUT/pipeline.py           remote_pipeline.py, for the runs no stock pipeline drives
    OUT/README.md             the model card: the run's recipe, data and metrics, and how to load it

    pipe = diffusers.DiffusionPipeline.from_pretrained(OUT)        # a stock pipeline, no remote code
    pipe = diffusers.DiffusionPipeline.from_pretrained(OUT, trust_remote_code=True)   # FasttrainPipeline

A pipeline kind is a row of PIPELINES: its class, the components it takes and `fits(export)`, the
reason it cannot drive an export (None: it can); the first row that fits names the folder's class.
What cannot be exported is refused with the reason: 2-D point models, mixed prediction (several
heads and a gate: no scheduler consumes them), UNets whose layers diffusers cannot express
(convert.unet_refusal), a DiT with mlp_ratio ≠ 4.

Every export is checked before it is written: on probe inputs (float64, conditional and null labels,
early and late timesteps) the converted network's output must equal the backbone's.
"""
from __future__ import annotations

import copy
import inspect
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import optional
from ..errors import InvalidInput
from ..pretrained.scheduler_config import PREDICTION_TYPES
from .common import scheduler_for, written_whole

FORMATS = ("diffusers", "lora")  # lora: a LoRA run's adapter (stable_diffusion.py: export_lora)
PIPELINE_FILE = Path(__file__).with_name("remote_pipeline.py")


@dataclass
class Export:
    """What an export is made of, for the pipeline kinds to judge."""
    bundle: object              # the run's ModelBundle
    component: str              # "transformer" | "unet"
    model: torch.nn.Module      # the converted diffusers network
    frequencies: str            # "diffusers", or "fasttrain" (a legacy DiT's: not the stock class)
    null: int | None            # the network's null label (None: no class table)
    codec: object | None        # latent runs: the VAE and normalisation (vae.LatentCodec)


@dataclass(frozen=True)
class PipelineKind:
    """A diffusers pipeline class an export folder can name, and when it can drive the run."""
    name: str
    components: tuple[str, ...]               # model_index.json's entries besides the scheduler
    fits: Callable[[Export], str | None]      # why it cannot drive this export (None: it can)
    custom: bool = False                      # OUT/pipeline.py (trust_remote_code=True)


def _dit_pipeline(e: Export) -> str | None:
    spec, lat = e.bundle.spec, (e.codec.record if e.codec else None)
    if e.component != "transformer" or e.codec is None or e.bundle.cfg.diffusion.schedule == "flow":
        return "DiTPipeline drives latent DiTs on VP schedules"
    if not spec.num_classes or e.null != 1000:
        return "DiTPipeline's null label is 1000 (class-conditional DiTs whose table has 1000 classes)"
    vae_scale = float(e.codec.vae.config.scaling_factor)
    if any(s != 0 for s in lat["shift"]) or any(abs(s - vae_scale) > 1e-6 * vae_scale for s in lat["scale"]):
        return "DiTPipeline decodes latents divided by the VAE's scaling_factor (data.latent_norm=vae, no shift)"
    return None if e.frequencies == "diffusers" else "its DiT has legacy timestep frequencies (not the stock class)"


def _ddim_pipeline(e: Export) -> str | None:
    if e.component != "unet" or e.codec is not None or e.bundle.spec.latents:
        return "DDIMPipeline drives pixel UNets"
    if e.null is not None or e.bundle.cfg.diffusion.schedule == "flow":
        return "DDIMPipeline drives unconditional UNets on VP schedules"
    return None


# the first that fits names the folder's pipeline (a new stock pipeline kind is a row)
PIPELINES = (
    PipelineKind("DiTPipeline", ("transformer", "vae"), _dit_pipeline),
    PipelineKind("DDIMPipeline", ("unet",), _ddim_pipeline),
    PipelineKind("FasttrainPipeline", ("transformer", "unet", "vae"), lambda e: None, custom=True),
)


def refusal(bundle) -> str | None:
    """Why this run has no diffusers pipeline (None if it has one)."""
    df, spec = bundle.cfg.diffusion, bundle.spec
    if not spec.image_size:
        return "it generates 2-D points; diffusers pipelines generate images"
    if spec.text is not None:
        from .stable_diffusion import refusal as text_refusal
        return text_refusal(bundle)
    if df.prediction not in (*PREDICTION_TYPES, "flow"):
        return (f"diffusion.prediction={df.prediction}: its heads and gate have no diffusers scheduler "
                f"(schedulers take one prediction type)")
    if (df.schedule == "flow") != (df.prediction == "flow"):
        return (f"prediction {df.prediction} on the {df.schedule} schedule: the export takes VP schedules with eps, v "
                f"or x0, and the flow schedule with flow prediction")
    return None


def diffusers_labels(y, t, num_classes: int, null: int | None):
    """fasttrain's labels (num_classes: the null label) as the diffusers network's (its null row)."""
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
    b = hf(x, t, class_labels=diffusers_labels(y, t, num_classes, null)).sample[:, :a.shape[1]]
    err = float((a - b).abs().max())
    if not err <= 1e-6 * max(1.0, float(a.abs().max())):
        raise RuntimeError(f"the converted network differs from fasttrain's by {err:.3g} (a conversion bug)")
    return err


def class_names(bundle) -> dict[str, str]:
    """id2label: the data's class names where the checkpoint records them, else the class ids."""
    k = bundle.spec.num_classes
    names = list(bundle.spec.class_names or [])
    return {str(i): str(names[i]) if len(names) == k else str(i) for i in range(k)}


def settings(e: Export) -> dict:
    """The `fasttrain` entry of model_index.json: what FasttrainPipeline samples with."""
    b = e.bundle
    cfg, spec = b.cfg, b.spec
    out = {"T": b.schedule.T, "schedule": cfg.diffusion.schedule, "flow_shift": float(cfg.diffusion.flow_shift),
           "prediction": cfg.diffusion.prediction,
           "channels": spec.channels, "image_size": spec.image_size, "num_classes": spec.num_classes,
           "null_label": e.null, "clip": 1.0 if spec.is_images else None, "timestep_frequencies": e.frequencies,
           "steps": int(cfg.sample.steps), "guidance": float(cfg.sample.guidance), "run_step": b.step}
    if spec.latents:
        out.update(latent_shift=list(spec.latents["shift"]), latent_scale=list(spec.latents["scale"]),
                   latent_norm=spec.latents["norm"])
    return out


def _convert(b, ema: bool) -> tuple[str, torch.nn.Module, str, int | None, float]:
    """(component, diffusers network, frequencies, null label, max |Δ| of the check) for the bundle."""
    from ..config import plain
    from ..models import MODELS
    from .convert import to_diffusers

    name = b.cfg.model.name
    args = {k: v for k, v in MODELS.args(name).items() if v is not inspect.Parameter.empty}
    args.update(plain(b.cfg.model.args))
    with b.averaged(ema) as net:
        component, model, frequencies, null = to_diffusers(net.net, args)
        err = verify(net.net, model, b.spec.num_classes, null, b.spec.shape, b.schedule.T)
    return component, model, frequencies, null, err



def export_diffusers(run: str, out: str, vae: str | None = None, ema: bool = True, to: str = "diffusers") -> dict:
    """Write the pipeline folder `out` for the run's checkpoint (`to="lora"`: a LoRA run's adapter as
    pytorch_lora_weights.safetensors); returns a summary."""
    from ..bundle import ModelBundle
    from .model_card import model_card

    diffusers = optional.diffusers("export --to diffusers")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidInput(f"export folder {out} already exists and is not empty (nothing was written)")
    b = ModelBundle.load(run, device="cpu", vae=vae)
    if vae and not b.spec.latents:
        raise InvalidInput(f"--vae: {run} was not trained on VAE latents (nothing was written)")
    if to == "lora":
        from .stable_diffusion import export_lora
        return export_lora(run, out, b, ema)
    from .sd3 import export_sd3, is_sd3

    if is_sd3(b):  # StableDiffusion3Pipeline with its text encoders (sd3.py)
        return export_sd3(run, out, b, ema)
    if b.spec.text is not None:  # stock SD / SDXL pipelines with their text encoders (stable_diffusion.py)
        from .stable_diffusion import export_text
        return export_text(run, out, b, ema)
    why = refusal(b)
    if why:
        raise InvalidInput(f"{run} cannot be exported to diffusers: {why}")
    component, model, frequencies, null, err = _convert(b, ema)
    e = Export(b, component, model, frequencies, null, b.decoder.codec if b.decodes else None)
    kind = next(k for k in PIPELINES if k.fits(e) is None)
    sched, note = scheduler_for(b)
    parts = {component: model, "vae": e.codec.vae if e.codec else None}
    index = {"_class_name": ["pipeline", kind.name] if kind.custom else kind.name,
             "_diffusers_version": diffusers.__version__, "scheduler": ["diffusers", type(sched).__name__]}
    for name in kind.components:
        index[name] = ["diffusers", type(parts[name]).__name__] if parts.get(name) is not None else [None, None]
    if b.spec.num_classes:
        index["id2label"] = class_names(b)
    if kind.custom:
        index["fasttrain"] = settings(e)
    with written_whole(out):
        model.save_pretrained(out / component)
        sched.save_pretrained(out / "scheduler")
        if e.codec is not None:
            e.codec.vae.save_pretrained(out / "vae")
        (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        if kind.custom:
            shutil.copyfile(PIPELINE_FILE, out / "pipeline.py")
        (out / "README.md").write_text(model_card(run, b, kind, index, ema))
    if note:
        print(f"fasttrain: note: {note}", file=sys.stderr)
    return {"out": str(out), "pipeline": kind.name, "network": type(model).__name__, "scheduler": type(sched).__name__,
            "vae": e.codec is not None, "max_abs_diff": err, "step": b.step, "weights": "ema" if ema else "raw",
            "remote_code": kind.custom}
