"""Conformance of `fasttrain export --to diffusers` over the matrix of what fasttrain trains: 5 networks
(fasttrain's UNet and DiT, a legacy DiT of a checkpoint before format 4, diffusers' UNet2DModel and
DiTTransformer2DModel) × pixel / latent × eps / v / x0 / flow × class-conditional / unconditional,
each cell a tiny network (8×8, a few channels) built without training, its weights moved off the zero
initialisation. Every cell exports to the pipeline PIPELINES picks (DDIMPipeline, DiTPipeline, or
FasttrainPipeline through pipeline.py), which

  * loads with DiffusionPipeline.from_pretrained (no remote code for a stock pipeline) and generates
    the images `fasttrain sample` generates for the same seed (trailing spacing, 4 steps: n divides T);
  * takes swapped schedulers (DDIM, Euler, UniPC, DPM-Solver; FlowMatch Euler and Heun for flow) and
    still gives sane images: finite, and near the exported scheduler's (Euler equal: both are DDIM);
  * saves with save_pretrained into a folder that loads again and generates the same images;
  * holds a network that, loaded alone from its subfolder, equals fasttrain's.
Mixed prediction is refused with the reason (tests/export/test_export.py)."""
import json

import pytest
import torch
from diffusers_fixtures import DIT, TINY_UNET, fake_run, save_tiny_vae

from fasttrain.bundle import ModelBundle
from fasttrain.export.dispatch import diffusers_labels, export_diffusers

diffusers = pytest.importorskip("diffusers")

HF_DIT = dict(DIT, num_embeds_ada_norm=1000)  # ImageNet's table: its null label is DiTPipeline's 1000
NETWORKS = {
    "unet": ["model.args.ch=8"],
    "dit": ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2", "model.args.heads=2"],
    "dit-legacy": ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2", "model.args.heads=2",
                   "model.args.convention=legacy"],
    "hf-unet": ["model.name=diffusers", "model.args.class_name=UNet2DModel",
                "model.args.config=" + json.dumps(TINY_UNET).replace('"', "")],
    "hf-dit": ["model.name=diffusers", "model.args.class_name=DiTTransformer2DModel",
               "model.args.config=" + json.dumps(HF_DIT).replace('"', "")],
}
# one schedule per prediction type, so that every schedule's diffusers name is exercised too
PREDICTIONS = {"eps": ["diffusion.schedule=linear"],
               "v": ["diffusion.prediction=v", "diffusion.schedule=cosine", "diffusion.zero_terminal_snr=true"],
               "x0": ["diffusion.prediction=x0", "diffusion.schedule=quad"],
               "flow": ["diffusion.prediction=flow", "diffusion.schedule=flow", "diffusion.weighting=simple"]}
SWAPS = {"vp": ["DDIMScheduler", "EulerDiscreteScheduler", "UniPCMultistepScheduler", "DPMSolverMultistepScheduler"],
         "flow": ["FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler"]}
STEPS, SEED, GUIDANCE = 4, 3, 1.5
CELLS = [(net, data, pred, cond) for net in NETWORKS for data in ("pixel", "latent") for pred in PREDICTIONS
         for cond in ("cond", "uncond")]


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    """The latent record of a tiny saved VAE (4×8×8 latents, normalised by its scaling_factor)."""
    from fasttrain.pretrained.vae import identity, latent_record, load_vae

    folder = save_tiny_vae(tmp_path_factory.mktemp("vae") / "vae")
    return latent_record({"channels": 4, "posterior": "mean_std", "vae": identity(load_vae(folder), folder)}, "vae")


def _call(pipe, kind: str, labels, n: int, generator, **kw):
    if kind == "DDIMPipeline":  # DDIMScheduler clips x̂0 as fasttrain does only with the clipped ε
        return pipe(batch_size=n, generator=generator, use_clipped_model_output=True, **kw).images
    if kind == "DiTPipeline":
        return pipe(class_labels=labels, guidance_scale=GUIDANCE, generator=generator, **kw).images
    return pipe(class_labels=labels, batch_size=n, guidance_scale=GUIDANCE, generator=generator, **kw).images


@pytest.mark.slow  # 80 cells, ~2 s each on 2 cores
@pytest.mark.parametrize("net,data,pred,cond", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_exportable_cell_behaves_like_a_diffusers_model(tmp_path, latents, net, data, pred, cond):
    from diffusers import DiffusionPipeline

    over = NETWORKS[net] + PREDICTIONS[pred] + (["model.class_conditional=false"] if cond == "uncond" else [])
    if data == "latent":
        over += ["data.name=latents", f"data.root={tmp_path / 'latents'}"]
    run = fake_run(tmp_path / "run", over, latents=latents if data == "latent" else None)
    res = export_diffusers(str(run), str(tmp_path / "out"))
    stock = {"DiTPipeline": net == "hf-dit" and data == "latent" and cond == "cond" and pred != "flow",
             "DDIMPipeline": net in ("unet", "hf-unet") and data == "pixel" and cond == "uncond" and pred != "flow"}
    assert res["pipeline"] == next((k for k, v in stock.items() if v), "FasttrainPipeline")
    assert res["remote_code"] == (res["pipeline"] == "FasttrainPipeline")

    # the pipeline equals fasttrain's sampler for the same seed
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "out"), trust_remote_code=res["remote_code"])
    pipe.set_progress_bar_config(disable=True)
    b = ModelBundle.load(run, device="cpu")
    labels = [1, 7, 9] if cond == "cond" else None
    x = b.generate(3, None if labels is None else torch.tensor(labels), seed=SEED, steps=STEPS,
                   guidance=GUIDANCE, solver="flow_euler" if pred == "flow" else "ddim")
    want = ((b.decode(x) if b.decodes else x) * 0.5 + 0.5).clamp(0, 1)
    got = _call(pipe, res["pipeline"], labels, 3, torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                output_type="pt")
    assert 0.05 < float(want.std())  # not a constant image
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    # any compatible scheduler swaps in (stock pipelines: those diffusers' own loop supports)
    kind = "flow" if pred == "flow" else "vp"
    swaps = {"FasttrainPipeline": SWAPS[kind], "DDIMPipeline": [],  # DDIMPipeline forces DDIMScheduler
             # DiTPipeline skips init_noise_sigma: only schedulers whose first sigma is 1
             "DiTPipeline": ["DDIMScheduler", "UniPCMultistepScheduler", "DPMSolverMultistepScheduler"]}
    exported, config = type(pipe.scheduler), pipe.scheduler.config
    for name in swaps[res["pipeline"]]:
        pipe.scheduler = getattr(diffusers, name).from_config(config)
        img = _call(pipe, res["pipeline"], labels, 3, torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                    output_type="pt")
        assert bool(torch.isfinite(img).all()) and img.min() >= 0 and img.max() <= 1, name
        gap = float((img - got).abs().mean())
        assert gap < (1e-3 if name in ("DDIMScheduler", "EulerDiscreteScheduler",
                                       "FlowMatchEulerDiscreteScheduler") else 0.1), (name, gap)
    pipe.scheduler = exported.from_config(config)

    # save_pretrained → from_pretrained: the same pipeline
    pipe.save_pretrained(str(tmp_path / "saved"))
    again = DiffusionPipeline.from_pretrained(str(tmp_path / "saved"), trust_remote_code=res["remote_code"])
    again.set_progress_bar_config(disable=True)
    assert type(again).__name__ == res["pipeline"]
    torch.testing.assert_close(_call(again, res["pipeline"], labels, 3, torch.Generator().manual_seed(SEED),
                                     num_inference_steps=STEPS, output_type="pt"), got, rtol=0, atol=1e-6)

    # the network alone is fasttrain's (a legacy DiT: with the pipeline file's frequencies call)
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    component = "transformer" if index.get("transformer", [None])[0] else "unet"
    alone = getattr(diffusers, index[component][1]).from_pretrained(str(tmp_path / "out" / component)).eval()
    if net == "dit-legacy":
        alone = again.transformer  # use_fasttrain_timestep_frequencies applied on loading
    xt, t = torch.randn((2,) + b.spec.shape), torch.tensor([5, 900])
    y = torch.tensor([3, 10]) if cond == "cond" else None  # 10: fasttrain's null label
    with b.averaged() as den, torch.no_grad():
        ref = den.net(xt, t, y)
        null = den.net.null_row if net.startswith("hf") else (10 if cond == "cond" else 0 if "dit" in net else None)
        out = alone(xt, t, class_labels=diffusers_labels(y, t, b.spec.num_classes, null)).sample[:, :ref.shape[1]]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * max(1.0, float(ref.abs().max())))
