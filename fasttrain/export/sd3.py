"""`fasttrain export RUN --to diffusers OUT` for an SD3 run: a StableDiffusion3Pipeline folder that stock
diffusers loads without remote code.

    OUT/transformer/                 the SD3Transformer2DModel with the EMA weights (`--raw`: the raw ones)
    OUT/vae/                         the VAE the latents were encoded with
    OUT/text_encoder{,_2,_3}/        the run's text encoders and their tokenizers (tokenizer{,_2,_3}/), copied
                                     from its text-encoder pipeline folder (text_encoder_3 absent: no T5)
    OUT/scheduler/                   FlowMatchEulerDiscreteScheduler with the run's diffusion.flow_shift
    OUT/model_index.json             written by diffusers' own save_pretrained
    OUT/README.md                    how to load it and which fasttrain command makes the same images

A LoRA run (model.lora.rank > 0) gets its adapter merged into the transformer here; `--to lora` writes the
adapter alone (stable_diffusion.export_lora, through StableDiffusion3Pipeline.save_lora_weights).

The pipeline samples what `fasttrain sample` does: its transformer takes σ·T (the backbone's time input,
models/diffusers_backbone.py), its latents are divided by the VAE's scaling_factor and shifted by its
shift_factor (fasttrain's data.latent_norm=vae), guidance mixes the velocities of the prompt and the
negative prompt (on the flow schedule the same as fasttrain's guidance on x̂0: both are affine in the
network's output with the same coefficients). The check before writing: on probe inputs the stock
transformer fed as the pipeline feeds it equals the backbone.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from .. import optional
from ..errors import InvalidInput
from ..pretrained import lora
from ..pretrained.scheduler_config import to_diffusers

CLASS = "SD3Transformer2DModel"


def is_sd3(bundle) -> bool:
    cfg = bundle.cfg
    return cfg.model.name == "diffusers" and cfg.model.args.get("class_name") == CLASS


def refusal(b) -> str | None:
    """Why this SD3 run has no StableDiffusion3Pipeline (None: it has one)."""
    lat, df = b.spec.latents, b.cfg.diffusion
    if not lat or b.decoder.codec is None:
        return "StableDiffusion3Pipeline decodes VAE latents, and the run's VAE is not available (pass --vae)"
    if df.schedule != "flow" or df.prediction != "flow":  # configure.py refuses it at training already
        return "StableDiffusion3Pipeline samples the flow schedule with flow prediction"
    vae = b.decoder.codec.vae.config
    scale, shift = float(vae.scaling_factor), float(vae.get("shift_factor") or 0.0)
    if any(abs(s - shift) > 1e-6 for s in lat["shift"]) or any(abs(s - scale) > 1e-6 * scale for s in lat["scale"]):
        return ("StableDiffusion3Pipeline decodes latents as z / scaling_factor + shift_factor: train with "
                "data.latent_norm=vae")
    if b.spec.text is None or b.prompts.encoders.family != "sd3":
        return "StableDiffusion3Pipeline encodes prompts with SD3's CLIP pair and T5 (prepare the data with them)"
    return None


@torch.no_grad()
def verify(b, backbone, transformer) -> float:
    """Max |Δ| between the backbone and the stock transformer given σ·T and the prompt encodings as
    StableDiffusion3Pipeline passes them, in float64, at early and late timesteps."""
    from ..conditioning import using

    net = copy.deepcopy(backbone).double().eval()
    hf = copy.deepcopy(transformer).double().eval()
    table = b.prompts.table(["a", ""], "").to("cpu")
    g = torch.Generator().manual_seed(0)
    T = b.schedule.T
    x = torch.randn((3,) + tuple(b.spec.shape), generator=g, dtype=torch.float64)
    t = torch.tensor([0, T // 2, T - 1])
    y = torch.tensor([0, 1, 0])
    with using(net, table):
        a = net(x, t, y)
        rows = table.gather(y, 3, torch.float64)
    sigma = b.schedule.sigma.to(torch.float64)[t] * T  # FlowMatchEulerDiscreteScheduler.timesteps: σ·T
    out = hf(x, encoder_hidden_states=rows["states"], pooled_projections=rows["pooled"], timestep=sigma).sample
    err = float((a - out[:, :a.shape[1]]).abs().max())
    if not err <= 1e-6 * max(1.0, float(a.abs().max())):
        raise RuntimeError(f"the SD3 transformer differs from fasttrain's backbone by {err:.3g} (an export bug)")
    return err


def vae_scale(vae) -> int:
    """Image pixels per latent (diffusers' pipelines: 2^(levels − 1))."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def card(run: str, b, ema: bool) -> str:
    sc = b.cfg.sample
    steps, guidance, side = int(sc.steps), float(sc.guidance), b.spec.image_size * vae_scale(b.decoder.codec.vae)
    return f"""# SD3 fine-tune exported by fasttrain

Run `{run}` at step {b.step} ({'EMA' if ema else 'raw'} weights); schedule flow with shift
{float(b.cfg.diffusion.flow_shift)}, {b.schedule.T} training timesteps.

```python
import torch
from diffusers import StableDiffusion3Pipeline

pipe = StableDiffusion3Pipeline.from_pretrained("OUT")
n, T = {steps}, {b.schedule.T}
sigmas = [round(T - i * T / n) / T for i in range(n)]  # fasttrain's trailing step grid, unshifted
images = pipe(["a prompt"] * 4, negative_prompt=[""] * 4, num_inference_steps=n, guidance_scale={guidance},
              sigmas=sigmas, height={side}, width={side},
              generator=[torch.Generator().manual_seed(i) for i in range(4)]).images
```

makes the images of `fasttrain sample {run} --n 4 --seed 0 --steps {steps} --solver flow_euler --spacing trailing
--guidance {guidance} --prompt "a prompt"` (the `sigmas` are fasttrain's unshifted step grid, (t + 1)/T;
the scheduler shifts them by {float(b.cfg.diffusion.flow_shift)}).
"""


def export_sd3(run: str, out: Path, b, ema: bool) -> dict:
    """Write the StableDiffusion3Pipeline folder `out` (empty or absent) for the SD3 run `b`."""
    diffusers = optional.diffusers("export --to diffusers")
    why = refusal(b)
    if why:
        raise InvalidInput(f"{run} cannot be exported to diffusers: {why}")
    with b.averaged(ema) as net:
        transformer = copy.deepcopy(net.net.model).float().eval()
        if lora.identity(b.net):  # a LoRA run's full pipeline: the adapter folded into the base weights
            transformer = lora.merged(transformer)
        err = verify(b, net.net, transformer)
    df = b.cfg.diffusion
    name, config = to_diffusers(df.schedule, df.T, False, df.prediction, False, shift=df.flow_shift)
    sched = getattr(diffusers, name).from_config(config)
    enc = b.prompts.encoders
    toks, encs = enc.tokenizers, enc.encoders
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=sched, vae=b.decoder.codec.vae, text_encoder=encs[0], tokenizer=toks[0],
        text_encoder_2=encs[1], tokenizer_2=toks[1], text_encoder_3=encs[2], tokenizer_3=toks[2])
    from .common import written_whole

    with written_whole(out):
        pipe.save_pretrained(out)
        index = json.loads((out / "model_index.json").read_text())
        (out / "README.md").write_text(card(run, b, ema))
    if encs[2] is None:
        print("fasttrain: note: the run's text encoders have no T5 (text_encoder_3): the pipeline zero-fills its "
              "part, as fasttrain did", file=sys.stderr)
    return {"out": str(out), "pipeline": index["_class_name"], "network": CLASS, "scheduler": name, "vae": True,
            "max_abs_diff": err, "step": b.step, "weights": "ema" if ema else "raw", "remote_code": False}
