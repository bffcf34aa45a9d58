"""`fasttrain export RUN --to diffusers OUT` for a Flux run: a FluxPipeline folder that stock diffusers loads
without remote code.

    OUT/transformer/                 the FluxTransformer2DModel with the EMA weights (`--raw`: the raw ones)
    OUT/vae/                         the VAE the latents were encoded with (16 channels, shift_factor)
    OUT/text_encoder{,_2}/           the run's CLIP-L and T5 and their tokenizers (tokenizer{,_2}/), from its
                                     text-encoder pipeline folder
    OUT/scheduler/                   FlowMatchEulerDiscreteScheduler: the run's shift, or its dynamic shift
                                     (use_dynamic_shifting with the run's base/max shift and sequence lengths)
    OUT/model_index.json             written by diffusers' own save_pretrained
    OUT/README.md                    how to load it and which fasttrain command makes the same images

A LoRA run gets its adapter merged into the transformer here; `--to lora` writes it alone through
FluxPipeline.save_lora_weights (export/stable_diffusion.py export_lora), `--to kohya` in sd-scripts' names
(export/kohya.py).

The pipeline samples what `fasttrain sample` does: the same packing, position ids and time input σ
(models/flux.py), the latents divided by scaling_factor and shifted by shift_factor (data.latent_norm=vae),
the same shift at sampling (FluxPipeline computes mu from the image tokens as diffusion/dynamic_shift.py
does), the embedded guidance as `guidance_scale`, and fasttrain's classifier-free guidance against the negative
prompt as `true_cfg_scale` (affine in the output with the same coefficients as guidance on x̂0). Checked
before writing: on probe inputs the stock transformer, fed through FluxPipeline's own _pack_latents and
_prepare_latent_image_ids, equals the backbone (float64).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import optional
from ..config import plain
from ..pretrained.scheduler_config import to_diffusers
from .common import stock_transformer, transformer_probe, written_whole

CLASS = "FluxTransformer2DModel"
PIPELINE = "FluxPipeline"


def is_flux(bundle) -> bool:
    cfg = bundle.cfg
    return cfg.model.name == "diffusers" and cfg.model.args.get("class_name") == CLASS


def refusal(b) -> str | None:
    """Why this Flux run has no FluxPipeline (None: it has one)."""
    lat = b.spec.latents
    if not lat or b.decoder.codec is None:
        return "FluxPipeline decodes VAE latents, and the run's VAE is not available (pass --vae)"
    vae = b.decoder.codec.vae.config
    scale, shift = float(vae.scaling_factor), float(vae.get("shift_factor") or 0.0)
    if any(abs(s - shift) > 1e-6 for s in lat["shift"]) or any(abs(s - scale) > 1e-6 * scale for s in lat["scale"]):
        return "FluxPipeline decodes latents as z / scaling_factor + shift_factor: train with data.latent_norm=vae"
    if b.spec.text is None or b.spec.text.get("family") != "flux":
        return "FluxPipeline encodes prompts with CLIP-L (pooled) and T5 (prepare the data with a Flux pipeline's)"
    return None


def scheduler(b):
    """The run's FlowMatchEulerDiscreteScheduler (scheduler_config.to_diffusers with its dynamic shift)."""
    diffusers = optional.diffusers("export --to diffusers")
    df = b.cfg.diffusion
    name, config = to_diffusers(df.schedule, df.T, False, df.prediction, False, shift=df.flow_shift,
                                dynamic=plain(df.dynamic_shift))
    return getattr(diffusers, name).from_config(config)


@torch.no_grad()
def verify(b, backbone, transformer) -> float:
    """Max |Δ| between the backbone and the stock transformer fed as FluxPipeline feeds it, float64."""
    from diffusers import FluxPipeline

    net, hf, x, t, rows, close = transformer_probe(b, backbone, transformer, "Flux")
    c, h, w = x.shape[1:]
    guidance = None if net.guidance is None else torch.full((3,), float(net.guidance), dtype=torch.float64)
    out = hf(hidden_states=FluxPipeline._pack_latents(x, 3, c, h, w), timestep=b.schedule.sigma.double()[t],
             guidance=guidance, pooled_projections=rows["pooled"], encoder_hidden_states=rows["states"],
             txt_ids=torch.zeros(rows["states"].shape[1], 3, dtype=torch.float64),
             img_ids=FluxPipeline._prepare_latent_image_ids(3, h // 2, w // 2, "cpu", torch.float64)).sample
    vae_scale = 2 ** (len(b.decoder.codec.vae.config.block_out_channels) - 1)
    return close(FluxPipeline._unpack_latents(out, h * vae_scale, w * vae_scale, vae_scale))


def embedded_guidance(b) -> float | None:
    """The embedded guidance the run samples with (None: the transformer has no guidance embedding)."""
    if not b.net.net.model.config.get("guidance_embeds"):
        return None
    given = b.cfg.sample.embedded_guidance
    return float(given if given is not None else b.net.net.guidance)


def card(run: str, b, ema: bool) -> str:
    sc, df = b.cfg.sample, b.cfg.diffusion
    steps, guidance = int(sc.steps), float(sc.guidance)
    side = b.spec.image_size * 2 ** (len(b.decoder.codec.vae.config.block_out_channels) - 1)
    embedded = embedded_guidance(b)
    dyn = df.dynamic_shift
    shift = (f"the resolution-dependent shift of FLUX.1-dev's scheduler (base_shift {dyn.base_shift}, max_shift "
             f"{dyn.max_shift})" if dyn.enabled else f"shift {float(df.flow_shift)}")
    extra = "" if embedded is None else f", guidance_scale={embedded}"
    return f"""# Flux fine-tune exported by fasttrain

Run `{run}` at step {b.step} ({'EMA' if ema else 'raw'} weights); flow matching, {b.schedule.T} training
timesteps, sampled with {shift}.

```python
import torch
from diffusers import FluxPipeline

pipe = FluxPipeline.from_pretrained("OUT")
n, T = {steps}, {b.schedule.T}
sigmas = [round(T - i * T / n) / T for i in range(n)]  # fasttrain's trailing step grid, unshifted
images = pipe(["a prompt"] * 4, negative_prompt=[""] * 4, true_cfg_scale={guidance}{extra},
              num_inference_steps=n, sigmas=sigmas, height={side}, width={side},
              generator=[torch.Generator().manual_seed(i) for i in range(4)]).images
```

makes the images of `fasttrain sample {run} --n 4 --seed 0 --steps {steps} --solver flow_euler --spacing trailing
--guidance {guidance} --prompt "a prompt"` (the `sigmas` are fasttrain's unshifted grid (t + 1)/T, FluxPipeline's
default linspace(1, 1/n, n) when n divides T; the scheduler shifts them).
"""


def export_flux(run: str, out: Path, b, ema: bool) -> dict:
    """Write the FluxPipeline folder `out` (empty or absent) for the Flux run `b`, whole or not at all
    (common.written_whole)."""
    diffusers = optional.diffusers("export --to diffusers")
    transformer, err = stock_transformer(run, b, ema, refusal, verify)
    sched = scheduler(b)
    enc = b.prompts.encoders
    pipe = diffusers.FluxPipeline(transformer=transformer, scheduler=sched, vae=b.decoder.codec.vae,
                                  text_encoder=enc.encoders[0], tokenizer=enc.tokenizers[0],
                                  text_encoder_2=enc.encoders[1], tokenizer_2=enc.tokenizers[1])
    with written_whole(out) as folder:
        pipe.save_pretrained(folder)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "README.md").write_text(card(run, b, ema))
    return {"out": str(out), "pipeline": index["_class_name"], "network": CLASS, "scheduler": type(sched).__name__,
            "vae": True, "max_abs_diff": err, "step": b.step, "weights": "ema" if ema else "raw", "remote_code": False}
