"""Text runs (SD 1.x/2.x, SDXL) exported as stock diffusers pipelines, no remote code (dispatch.py sends them here).

    OUT/model_index.json      StableDiffusionPipeline or StableDiffusionXLPipeline, written by diffusers'
                              own save_pretrained
    OUT/unet/                 the UNet2DConditionModel with the EMA weights (`--raw`: the raw ones)
    OUT/vae/                  the VAE the run's latents were encoded with
    OUT/text_encoder[_2]/, OUT/tokenizer[_2]/   copied from the pipeline folder the run's text encoders came
                              from (the recorded folder, checked against the recorded hashes)
    OUT/scheduler/            DDIMScheduler with the run's schedule and prediction type (scheduler_config.py)
    OUT/README.md             the model card

    pipe = StableDiffusionPipeline.from_pretrained(OUT)
    pipe(prompts, guidance_scale=g, generator=[torch.Generator().manual_seed(i) for i in ...])

reproduces `fasttrain sample --prompt ... --guidance g` (image i seeded with seed + i). Why it matches:
  * guidance: fasttrain guides x̂0, the pipelines guide the network output; at fixed x_t every prediction
    type is affine in x̂0, so the two are equal (latents are not clipped);
  * the unconditional side is the empty prompt's encoding in both (SD 1.x: the pipeline encodes ""; SDXL:
    `force_zeros_for_empty_prompt=False`, else diffusers would use zeros, which fasttrain never trained on);
  * SDXL's micro-conditions: (H, W, 0, 0, H, W) of the requested size in both (fasttrain: the trained size);
  * spacing: the pipelines set `steps_offset=1` on a scheduler that has 0, which moves leading spacing by one
    step; the exported scheduler has trailing spacing (a note says so when the run samples otherwise), on
    which DDIMScheduler's step t − T//n visits fasttrain's timesteps when the step count divides T;
  * latents leave the network as the VAE's scaled latents only with data.latent_norm=vae and a VAE without
    shift_factor: a per-channel normalisation has no place in these pipelines and is refused.
Before anything is written, the pipeline's own prompt encoding (`encode_prompt`, with the run's clip_skip)
is compared with fasttrain's on probe prompts; a difference refuses the export with the reason.
"""
from __future__ import annotations

import copy
import inspect
import json
import sys
from pathlib import Path

import torch

from .. import optional
from ..errors import InvalidInput
from ..pretrained import lora, text_lora
from ..pretrained.scheduler_config import PREDICTION_TYPES

PIPELINES = {"sd1": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline"}
PROBES = ["a photo", ""]


def refusal(bundle) -> str | None:
    """Why a text run has no stock SD / SDXL pipeline (None: it has one)."""
    df, spec = bundle.cfg.diffusion, bundle.spec
    family = spec.text.get("family") if spec.text else None
    if family not in PIPELINES:
        return f"its text encoders are of the {family} family; SD 1.x/2.x and SDXL runs export as stock pipelines"
    if df.prediction not in PREDICTION_TYPES or df.schedule == "flow":
        return (f"diffusion.prediction={df.prediction} on the {df.schedule} schedule: {PIPELINES[family]} takes a "
                f"VP schedule with eps, v or x0 prediction")
    lat = spec.latents or {}
    if lat.get("norm") != "vae" or any(s != 0 for s in lat.get("shift", [1])):
        return (f"its latents are normalised with data.latent_norm={lat.get('norm')}: {PIPELINES[family]} decodes "
                f"latents divided by the VAE's scaling_factor (data.latent_norm=vae, a VAE without shift)")
    return None


def _pipeline(diffusers, family: str, unet, vae, encoders, scheduler):
    if family == "sd1":
        return diffusers.StableDiffusionPipeline(vae=vae, text_encoder=encoders.encoders[0],
                                                 tokenizer=encoders.tokenizers[0], unet=unet, scheduler=scheduler,
                                                 safety_checker=None, feature_extractor=None,
                                                 requires_safety_checker=False)
    return diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=encoders.encoders[0],
                                               text_encoder_2=encoders.encoders[1],
                                               tokenizer=encoders.tokenizers[0], tokenizer_2=encoders.tokenizers[1],
                                               unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=False,
                                               add_watermarker=False)


@torch.no_grad()
def check_encoding(pipe, family: str, encoders) -> float:
    """Max |Δ| between the pipeline's encode_prompt and fasttrain's encoding (states; SDXL: and pooled) on
    probe prompts; InvalidInput where the pipeline cannot encode as the run did."""
    ours = encoders.encode(PROBES)
    skip = encoders.clip_skip or None
    try:
        if family == "sd1":
            states = pipe.encode_prompt(PROBES, "cpu", 1, False, clip_skip=skip)[0]
            pooled = None
        else:
            out = pipe.encode_prompt(PROBES, device="cpu", num_images_per_prompt=1,
                                     do_classifier_free_guidance=False, clip_skip=skip)
            states, pooled = out[0], out[2]
    except AttributeError as e:
        raise InvalidInput(f"the installed diffusers' {type(pipe).__name__} cannot encode prompts as this run did "
                           f"(clip_skip={skip}: {e}); sample it with `fasttrain sample --prompt`") from None
    err = float((states.float() - ours["states"]).abs().max())
    if pooled is not None:
        err = max(err, float((pooled.float() - ours["pooled"]).abs().max()))
    if not err <= 1e-5 * max(1.0, float(ours["states"].abs().max())):
        raise InvalidInput(f"{type(pipe).__name__} encodes prompts differently from this run (max |Δ| {err:.3g}, "
                           f"clip_skip={skip}); sample it with `fasttrain sample --prompt`")
    return err


def export_text(run: str, out: Path, b, ema: bool) -> dict:
    """Write the SD / SDXL pipeline folder `out` for the text run loaded as bundle `b`."""
    from .common import scheduler_for, written_whole
    from .model_card import model_card

    diffusers = optional.diffusers("export --to diffusers")
    why = refusal(b)
    if why:
        raise InvalidInput(f"{run} cannot be exported to diffusers: {why}")
    family = b.spec.text["family"]
    encoders = b.prompts.encoders  # the recorded folder, its hashes checked (generation/prompts.py)
    live = text_lora.live_of(b.net)
    with b.averaged(ema) as net:
        unet = copy.deepcopy(net.net.model).eval()
        if live is not None:  # text-encoder LoRA: the adapted encoders, merged below
            encoders = copy.deepcopy(live).text_encoders()
    if lora.identity(b.net):  # a LoRA run's full pipeline: the adapter folded into the base weights
        unet = lora.merged(unet)
    if live is not None:
        encoders.encoders = [lora.merged(e).eval() for e in encoders.encoders]
    sched, note = scheduler_for(b)
    if sched.config.timestep_spacing == "leading":  # the SD pipelines force steps_offset=1 on it; fasttrain's is 0
        sched = type(sched).from_config(sched.config, timestep_spacing="trailing")
        note = (f"the run samples with sample.spacing={b.cfg.sample.spacing}: {PIPELINES[family]} sets steps_offset=1 "
                f"on a leading scheduler, which fasttrain's leading spacing does not have, so the exported scheduler "
                f"has trailing spacing and the pipeline equals `fasttrain sample --spacing trailing`")
    pipe = _pipeline(diffusers, family, unet, b.decoder.codec.vae, encoders, sched)
    err = check_encoding(pipe, family, encoders)
    kind = type("Kind", (), {"name": type(pipe).__name__, "custom": False})()
    with written_whole(out) as folder:
        pipe.save_pretrained(folder, safe_serialization=True)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "README.md").write_text(model_card(run, b, kind, index, ema))
    if note:
        print(f"fasttrain: note: {note}", file=sys.stderr)
    return {"out": str(out), "pipeline": type(pipe).__name__, "network": type(unet).__name__,
            "scheduler": type(sched).__name__, "vae": True, "text_encoders": family, "max_abs_diff": err,
            "step": b.step, "weights": "ema" if ema else "raw", "remote_code": False}


def export_lora(run: str, out: Path, b, ema: bool) -> dict:
    """OUT/pytorch_lora_weights.safetensors: a LoRA run's adapter in diffusers' format, written by the
    pipeline class's own `save_lora_weights` (as diffusers' train_text_to_image_lora.py, and for SD3's and
    Flux's transformers as train_dreambooth_lora_sd3.py and train_dreambooth_lora_flux.py), which
    `pipe.load_lora_weights(OUT)` applies to the base pipeline the run was trained on."""
    diffusers = optional.diffusers("export --to lora")
    from . import flux, sd3

    if not lora.identity(b.net):
        raise InvalidInput(f"{run} was not trained with LoRA (model.lora.rank=0): it has no adapter to export; "
                           f"export the whole pipeline with --to diffusers")
    is_flux = flux.is_flux(b)
    transformer = sd3.is_sd3(b) or is_flux  # a transformer whose peft names are saved as they are
    if is_flux:
        why = flux.refusal(b)
    elif transformer:
        why = sd3.refusal(b)
    else:
        why = refusal(b) if b.spec.text else ("LoRA weights are exported for SD / SDXL pipelines, SD3 and Flux "
                                              "pipelines (text runs)")
    if why:
        raise InvalidInput(f"{run} cannot be exported as LoRA weights: {why}")
    name = (flux.PIPELINE if is_flux else "StableDiffusion3Pipeline" if transformer
            else PIPELINES[b.spec.text["family"]])
    part = "transformer" if transformer else "unet"  # the save_lora_weights argument: {part}_lora_layers
    with b.averaged(ema) as net:
        model = net.net.model
        state = lora.adapter_state(model)
        # peft's names as they are, for UNets too: diffusers 0.42's loader reads the older lora.down spelling
        # (convert_state_dict_to_diffusers, train_text_to_image_lora.py) of an adapter on attention and resnet
        # layers without its attention modules (tests/pretrained/test_kohya.py)
        layers = {k: v.detach().clone().contiguous() for k, v in state.items()}
        meta = model.peft_config["default"].to_dict()
        parts = {part: (layers, meta)}
        live = text_lora.live_of(net)
        for i, enc in enumerate(live.encoders if live is not None else ()):  # text-encoder LoRA: text_encoder[_2]
            te = {k: v.detach().clone().contiguous() for k, v in text_lora.adapter_state(enc).items()}
            parts[("text_encoder", "text_encoder_2")[i]] = (te, text_lora.adapter_config(enc))
    cls = getattr(diffusers, name)
    kwargs = {"safe_serialization": True}
    accepted = inspect.signature(cls.save_lora_weights).parameters
    for key, (tensors, config) in parts.items():
        kwargs[f"{key}_lora_layers"] = tensors
        if f"{key}_lora_adapter_metadata" in accepted:
            config["target_modules"] = sorted(config["target_modules"])
            kwargs[f"{key}_lora_adapter_metadata"] = config  # keeps alpha (the scale alpha / rank) with the weights
    from .common import written_whole

    with written_whole(out) as folder:
        cls.save_lora_weights(str(folder), **kwargs)
    base = lora.identity(b.net)["pipeline"]
    return {"out": str(out), "pipeline": name, "network": "LoRA", "scheduler": "-", "vae": False,
            "max_abs_diff": 0.0, "step": b.step, "weights": "ema" if ema else "raw", "remote_code": False,
            "base": base, "tensors": sum(len(t) for t, _ in parts.values())}
