"""The model card of an export (OUT/README.md, export/dispatch.py): the Hugging Face front matter (library,
pipeline tag, tags), how to load and sample it, the run's recipe and data, its metrics (RUN/eval.json
or the final evaluation in RUN/summary.json), and the `fasttrain sample` command whose images the
pipeline reproduces for the same seed."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import plain


def _metrics(run: str) -> tuple[dict, str]:
    """The run's latest evaluation and where it came from ({} if none)."""
    from ..checkpoint import resolve

    folder = resolve(run).parent
    for name, pick in (("eval.json", lambda d: d), ("summary.json", lambda d: d.get("eval") or {})):
        try:
            found = pick(json.loads((folder / name).read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, dict) and found:
            return found, name
    return {}, ""


def _call(kind, index: dict, b) -> tuple[str, str]:
    """(the pipeline call, the `fasttrain sample` flags whose images it gives) for seed 0."""
    sc, classes = b.cfg.sample, b.spec.num_classes
    steps, guidance = int(sc.steps), float(sc.guidance)
    labels = [i % classes for i in range(4)] if classes else None
    # `fasttrain sample` seeds image i with seed + i (generation/ranks.py): one generator per image
    args = [f"num_inference_steps={steps}", "generator=[torch.Generator().manual_seed(i) for i in range(4)]"]
    if b.spec.text is not None:  # export/stable_diffusion.py: a stock SD / SDXL pipeline, the empty prompt as negative
        prompt = (list(sc.prompts) or list(b.spec.text.get("prompts") or []) or ["a photo"])[0]
        args = [f"prompt=[{prompt!r}] * 4", f"guidance_scale={guidance}"] + args
        return (f"pipe({', '.join(args)}).images",
                f"--n 4 --seed 0 --steps {steps} --spacing trailing --solver ddim --prompt {json.dumps(prompt)} "
                f"--guidance {guidance}")
    if kind.name == "DDIMPipeline":
        args = ["batch_size=4"] + args + ["eta=0.0", "use_clipped_model_output=True"]
    elif labels is not None:
        args = [f"class_labels={labels}", f"guidance_scale={guidance}"] + args
    else:
        args = ["batch_size=4"] + args
    solver = "flow_euler" if b.cfg.diffusion.schedule == "flow" else "ddim"  # what the exported scheduler does
    flags = f"--n 4 --seed 0 --steps {steps} --spacing trailing --solver {solver}"
    if labels is not None and kind.name != "DDIMPipeline":
        flags += f" --guidance {guidance}"
    return f"pipe({', '.join(args)}).images", flags


def model_card(run: str, b, kind, index: dict, ema: bool) -> str:
    cfg, spec = b.cfg, b.spec
    df, o, d = cfg.diffusion, cfg.optim, cfg.data
    network = next(v[1] for k, v in index.items() if k in ("transformer", "unet") and v[0])
    conditioning = "text-to-image" if spec.text else "class-conditional" if spec.num_classes else "unconditional"
    tags = ["fasttrain", f"diffusers:{kind.name}", conditioning,
            "latent-diffusion" if spec.latents else "pixel-diffusion"]
    front = ["---", "library_name: diffusers"]
    if not spec.num_classes:
        front.append(f"pipeline_tag: {'text-to-image' if spec.text else 'unconditional-image-generation'}")
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    call, flags = _call(kind, index, b)
    remote = ", trust_remote_code=True" if kind.custom else ""
    size = f"{spec.image_size}×{spec.image_size}"
    lines = [f"# {Path(str(run)).name or run}: a {network} trained with fasttrain", "",
             f"{'Text-conditioned' if spec.text else 'Class-conditional' if spec.num_classes else 'Unconditional'} "
             f"{'latent' if spec.latents else 'pixel'} "
             f"diffusion on `{d.name}` ({spec.channels}×{size}), {b.step} step{'' if b.step == 1 else 's'} "
             f"({b.images} images), "
             f"exported with its {'EMA' if ema else 'raw'} weights as a diffusers `{kind.name}`"
             f"{' (pipeline.py: no stock pipeline drives it)' if kind.custom else ''}.", "",
             "## Use", "", "```python", "import torch", "from diffusers import DiffusionPipeline", "",
             f'pipe = DiffusionPipeline.from_pretrained("path/to/this/folder"{remote})', f"images = {call}", "```",
             "", f"For the same seed these are the images of `fasttrain sample --ckpt {run} {flags} --out DIR` "
             f"({'labels cycling through the classes, as `sample` gives them; ' if spec.num_classes else ''}"
             f"fasttrain draws its noise as the pipeline does, from torch.Generator().manual_seed(seed))."]
    if kind.name == "DDIMPipeline":
        lines += ["DDIMPipeline clips x̂0 as fasttrain does only with `use_clipped_model_output=True`."]
    if "id2label" in index:
        names = ", ".join(f"{k}: {v}" for k, v in list(index["id2label"].items())[:20])
        lines += ["", f"Classes (`id2label`; `pipe.get_label_ids([...])` maps names): {names}"
                      f"{' …' if len(index['id2label']) > 20 else ''}."]
    zts = ", zero terminal SNR" if df.zero_terminal_snr else ""
    sched = f"{index['scheduler'][1]} ({df.schedule}, T = {df.T}{zts}, {df.prediction} prediction)"
    model_args = json.dumps(plain(cfg.model.args)) if cfg.model.args else "the preset's"
    rows = [("network", f"`{cfg.model.name}` {model_args}, {sum(p.numel() for p in b.net.parameters()):,} "
                        f"parameters"),
            ("data", f"`{d.name}`{f' from {d.root}' if d.root else ''}, {spec.channels}×{size}, "
                     f"{spec.num_classes or 'no'} classes"),
            ("diffusion", f"{df.schedule} schedule, T = {df.T}, {df.prediction} prediction, {df.weighting} weighting "
                          f"{json.dumps(plain(df.weighting_args))}, {df.sampler} timesteps "
                          f"{json.dumps(plain(df.sampler_args))}"),
            ("optimizer", f"lr {o.lr}, batch {d.batch_size} × {cfg.train.grad_accum} accumulation, EMA decay "
                          f"{o.ema_decay}, label dropout {cfg.model.label_dropout if spec.num_classes else '—'}"),
            ("scheduler", sched), ("sampling", f"{cfg.sample.solver}, {cfg.sample.steps} steps, "
                                                f"{cfg.sample.spacing} spacing, guidance {cfg.sample.guidance}")]
    if spec.latents:
        vae = (spec.latents.get("vae") or {}).get("path", "—")
        rows.insert(2, ("latents", f"VAE {vae}, normalisation `{spec.latents['norm']}` (per channel: shift "
                                   f"{spec.latents['shift']}, scale {spec.latents['scale']})"))
    lines += ["", "## Training recipe", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    metrics, source = _metrics(run)
    shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lines += ["", "## Metrics", ""]
    if shown:
        lines += [f"From the run's `{source}` (fasttrain's evaluation settings):", "", "| metric | value |",
                  "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in shown.items()]
    else:
        lines += ["The run recorded no evaluation (`fasttrain eval --ckpt RUN` writes one)."]
    return "\n".join(front + lines) + "\n"
