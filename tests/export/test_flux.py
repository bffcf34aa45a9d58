"""Flux (issue 44, item 1): FluxTransformer2DModel as a backbone on a tiny FLUX.1-shaped pipeline folder
(flux_fixtures.py: CLIP-L + T5, a 16-channel VAE with shift_factor, FLUX.1-dev's dynamically shifting scheduler),
full and LoRA fine-tuning that resume exactly, the timestep strategies, the FluxPipeline export reproducing
fasttrain's samples (the resolution-dependent shift at sampling, the embedded guidance, true CFG) and its LoRA
weights applied by FluxPipeline.load_lora_weights."""
import json

import pytest
import torch
from flux_fixtures import DEV_SCHEDULER, FLUX, save_flux
from text_fixtures import write_captioned
from text_runs import FLUX_TRAIN as TRAIN

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.diffusion import dynamic_shift, schedule
from fasttrain.diffusion.solvers import spacing
from fasttrain.errors import ConfigError, InvalidInput
from fasttrain.pretrained.scheduler_config import from_diffusers
from fasttrain.train import train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

PROMPTS = ["a red square", "a blue circle"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    pipe = save_flux(root / "pipe")
    lat = root / "lat"
    assert main(["data", "prepare", str(write_captioned(root / "img")), "--vae", str(pipe), "--vae-subfolder", "vae",
                 "--text-encoders", str(pipe), "--latents-out", str(lat), "--image-size", "16", "--batch-size",
                 "4"]) == 0
    return {"root": root, "pipe": pipe, "lat": lat}


def _args(flux, run, *more, pipe=None):
    return [f"run_dir={run}", f"data.root={flux['lat']}", f"model.args.pretrained={pipe or flux['pipe']}", *TRAIN,
            *more]


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _sample(pipe, steps, guidance, sigmas=None, **kw):
    """FluxPipeline's latents for PROMPTS (one generator per image, fasttrain's negative prompt as true CFG),
    unpacked to fasttrain's C×h×w."""
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    got = pipe(PROMPTS, negative_prompt=["a dog"] * 2, true_cfg_scale=guidance, num_inference_steps=steps,
               height=16, width=16, output_type="latent", generator=gens,
               **({} if sigmas is None else {"sigmas": sigmas}), **kw).images
    return diffusers.FluxPipeline._unpack_latents(got, 16, 16, 2)


def test_flux_prompt_encoding_is_flux_pipelines(flux):
    from fasttrain.pretrained.text_encoders import TextEncoders

    enc = TextEncoders.load(flux["pipe"])
    assert enc.family == "flux"
    ours = enc.encode(PROMPTS + [""])
    states, pooled, _ = diffusers.FluxPipeline.from_pretrained(flux["pipe"]).encode_prompt(PROMPTS + [""],
                                                                                            prompt_2=None)
    assert ours["states"].shape == (3, 512, 32) and ours["pooled"].shape == (3, 24)  # T5 at 512 tokens, CLIP pooled
    torch.testing.assert_close(ours["states"], states.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours["pooled"], pooled.float(), atol=1e-6, rtol=1e-6)


def test_dynamic_shift_is_flux_pipelines_and_training_is_unshifted():
    """FLUX.1-dev's scheduler: training sigmas unshifted (its __init__, which diffusers' Flux script samples
    from), sampling sigmas shifted by mu(image tokens) exactly as FluxPipeline + set_timesteps(mu=...) make them."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from omegaconf import OmegaConf

    keys = from_diffusers({"_class_name": "FlowMatchEulerDiscreteScheduler", **DEV_SCHEDULER}, "x")
    assert keys["diffusion.flow_shift"] == 1.0 and keys["diffusion.dynamic_shift.enabled"] is True
    sched = diffusers.FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER)
    torch.testing.assert_close(sched.sigmas.flip(0).double(), schedule("flow", 1000).sigma, atol=1e-6, rtol=0)
    dyn = OmegaConf.create({k.rsplit(".", 1)[1]: v for k, v in keys.items() if "dynamic_shift." in k})
    for side, steps in ((8, 4), (128, 25), (64, 3)):  # latent sides: 16 tokens, 4096 (max_shift), 1024
        n = dynamic_shift.tokens(side)
        assert dynamic_shift.mu(n, dyn) == pytest.approx(calculate_shift(n, 256, 4096, 0.5, 1.15), abs=1e-12)
        grid = [(t + 1) / 1000 for t in spacing("flow_euler", schedule("flow", 1000), steps, "trailing")]
        sched.set_timesteps(steps, sigmas=grid, mu=dynamic_shift.mu(n, dyn))
        ours = schedule("flow", 1000, shift=dynamic_shift.shift_at(n, dyn)).sigma[[round(s * 1000) - 1 for s in grid]]
        torch.testing.assert_close(sched.sigmas[:-1].double(), ours, atol=1e-6, rtol=0)
    assert dynamic_shift.shift_at(4096, dyn) == pytest.approx(2.718281828 ** 1.15, rel=1e-6)


def test_the_scripts_timestep_densities_are_fasttrains_samplers_mirrored():
    """train_dreambooth_lora_flux.py's --weighting_scheme logit_normal / mode draws u, index (u·T).long() into the
    scheduler's descending timesteps (σ = (T − index)/T, fasttrain's t = T − 1 − index): the same distribution as
    fasttrain's logit_normal with mean −m (the docs' mapping) and mode with the same scale; +m, or another
    scale, is not (the comparison can fail)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from fasttrain.diffusion.samplers import LogitNormal, Mode

    sched, n = schedule("flow", 1000), 200_000
    cases = [("logit_normal", {"logit_mean": 0.7, "logit_std": 1.3}, LogitNormal(sched, mean=-0.7, std=1.3),
              LogitNormal(sched, mean=0.7, std=1.3)),
             ("mode", {"mode_scale": 1.29}, Mode(sched, scale=1.29), Mode(sched, scale=0.5))]
    for scheme, kw, ours, other in cases:
        u = compute_density_for_timestep_sampling(weighting_scheme=scheme, batch_size=n,
                                                  **{"logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29, **kw},
                                                  generator=torch.Generator().manual_seed(0))
        t = 999 - (u * 1000).long()
        cdf = torch.bincount(t, minlength=1000).double().cumsum(0) / n
        assert float((cdf - ours.probs().cumsum(0)).abs().max()) < 0.006, scheme  # Kolmogorov-Smirnov distance
        assert float((cdf - other.probs().cumsum(0)).abs().max()) > 0.05, scheme


def test_flux_trains_resumes_exactly_and_flux_pipeline_makes_its_samples(flux, tmp_path):
    """Full fine-tune: 2 steps + resume to 3 = 3 straight; `fasttrain sample --prompt` runs; the FluxPipeline
    export (dynamic shift, embedded guidance, true CFG) makes fasttrain's latents to 1e-4, with its default
    sigmas (n divides T) and with fasttrain's grid given; without the shift the samples differ."""
    a, b = tmp_path / "a", tmp_path / "b"
    more = ["train.steps=3", "optim.lr=3e-3", "sample.embedded_guidance=2.5"]
    train(load_config("default", _args(flux, a, *more)))
    train(load_config("default", _args(flux, b, *more[1:], "train.steps=2")))
    train(load_config("default", _args(flux, b, *more), resume=True), resume=True)
    assert len(_losses(a)) == 3 and _losses(a) == _losses(b)
    sa, sb = (torch.load(x / "last.pt", weights_only=True)["model"] for x in (a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and not any("flow_sigma" in k for k in sa)
    ba = ModelBundle.load(a, device="cpu")
    assert ba.spec.text["family"] == "flux" and ba.cfg.diffusion.dynamic_shift.enabled
    assert ba.net.net.guidance == 3.5  # the training value (train_dreambooth_lora_flux.py --guidance_scale)
    assert main(["sample", "--ckpt", str(a), "--n", "2", "--steps", "2", "--prompt", "a red square", "--guidance", "2",
                 "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "00001.png").is_file()

    out = tmp_path / "export"
    assert main(["export", str(a), "--to", "diffusers", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and index["text_encoder_2"][1] == "T5EncoderModel"
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["use_dynamic_shifting"] is True
    pipe = diffusers.FluxPipeline.from_pretrained(out)
    made = {}
    for steps in (4, 3):
        made[steps] = ba.generate(2, seed=0, steps=steps, solver="flow_euler", guidance=2.0, first_image=0,
                                  prompts=PROMPTS, negative_prompt="a dog", spacing="trailing")
        grid = [(t + 1) / 1000 for t in spacing("flow_euler", ba.schedule, steps, "trailing")]
        got = _sample(pipe, steps, 2.0, None if steps == 4 else grid, guidance_scale=2.5)
        assert made[steps].shape == (2, 16, 8, 8) and (got - made[steps]).abs().max() <= 1e-4
    ba.cfg.diffusion.dynamic_shift.enabled = False  # the training table at sampling: other latents
    plain = ba.generate(2, seed=0, steps=4, solver="flow_euler", guidance=2.0, first_image=0, prompts=PROMPTS,
                        negative_prompt="a dog", spacing="trailing")
    assert (plain - made[4]).abs().max() > 1e-3 and ba.schedule.shift == 1.0


def test_flux_lora_resumes_exactly_and_both_exports_give_its_samples(flux, tmp_path):
    from diffusers import FluxTransformer2DModel

    lora = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("default", _args(flux, a, "train.steps=3", *lora)))
    train(load_config("default", _args(flux, b, "train.steps=2", *lora)))
    train(load_config("default", _args(flux, b, "train.steps=3", *lora), resume=True), resume=True)
    assert len(_losses(a)) == 3 and _losses(a) == _losses(b)
    st = torch.load(a / "last.pt", weights_only=True)
    assert st["model"] and all("lora_" in k for k in st["model"]) and st["lora"]["sha256"]
    assert any("single_transformer_blocks.0.attn.to_q" in k for k in st["model"])  # to_q: both kinds of block
    ba = ModelBundle.load(a, device="cpu")
    ours = ba.generate(2, seed=0, steps=4, solver="flow_euler", guidance=2.0, first_image=0, prompts=PROMPTS,
                       negative_prompt="a dog", spacing="trailing")
    full, out = tmp_path / "full", tmp_path / "lora"
    assert main(["export", str(a), "--to", "diffusers", str(full)]) == 0
    assert (_sample(diffusers.FluxPipeline.from_pretrained(full), 4, 2.0) - ours).abs().max() <= 1e-4
    assert main(["export", str(a), "--to", "lora", str(out)]) == 0
    base = diffusers.FluxPipeline.from_pretrained(
        full, transformer=FluxTransformer2DModel.from_pretrained(flux["pipe"], subfolder="transformer"))
    plain = _sample(base, 4, 2.0)
    base.load_lora_weights(str(out))
    assert (_sample(base, 4, 2.0) - ours).abs().max() <= 1e-4 and (plain - ours).abs().max() > 1e-3


@pytest.mark.parametrize("over", [
    ["diffusion.sampler=logit_normal", "diffusion.weighting=flow_sigma_sqrt", "diffusion.noise.offset=0.05"],
    ["diffusion.sampler=mode", "diffusion.weighting=flow_cosmap", "diffusion.loss.type=huber", "schnell"],
    ["diffusion.sampler=adaptive", "diffusion.sampler_args.every=2", "diffusion.backend=torch", "parallel.ac=full"],
])
def test_flux_composes_with_timestep_strategies_and_resumes_exactly(flux, tmp_path, over):
    """Samplers, weightings, noise and loss options on the Flux backbone; FLUX.1-schnell's kind of pipeline
    (a static shift, no guidance embedding) too."""
    pipe = _schnell(flux) if "schnell" in over else None
    over = [o for o in over if o != "schnell"]
    for run, steps, resume in (("a", 3, False), ("b", 2, False), ("b", 3, True)):
        cfg = load_config("default", _args(flux, tmp_path / run, f"train.steps={steps}", *over, pipe=pipe),
                          resume=resume)
        train(cfg, resume=resume)
    assert len(_losses(tmp_path / "a")) == 3 and _losses(tmp_path / "a") == _losses(tmp_path / "b")
    assert all(v == v for v in _losses(tmp_path / "a"))
    if pipe is not None:
        b = ModelBundle.load(tmp_path / "a", device="cpu")
        assert b.schedule.shift == 2.0 and not b.cfg.diffusion.dynamic_shift.enabled and b.net.net.guidance is None


def test_flux_refusals_are_one_line(flux, tmp_path, capsys):
    with pytest.raises(ConfigError, match="'diffusion.flow_shift': 3.0 .*has 2.0"):  # a static pipeline fixes it
        load_config("default", _args(flux, tmp_path / "r", "diffusion.flow_shift=3.0", pipe=_schnell(flux)))
    cfg = load_config("default", _args(flux, tmp_path / "r", "diffusion.flow_shift=3.0"))  # dynamic: a free choice
    assert cfg.diffusion.flow_shift == 3.0 and cfg.diffusion.dynamic_shift.enabled
    with pytest.raises(ConfigError, match="'diffusion.dynamic_shift.enabled': True .*FluxTransformer2DModel"):
        load_config("default", ["diffusion.dynamic_shift.enabled=true"])
    with pytest.raises(InvalidInput, match="model.args.guidance=2.0: this FluxTransformer2DModel has no guidance"):
        train(load_config("default", _args(flux, tmp_path / "g", "train.steps=1", "model.args.guidance=2.0",
                                           pipe=_schnell(flux))))
    with pytest.raises(ConfigError, match="'model.args.guidance'.*not a UNet2DModel's"):
        load_config("default", ["model.name=diffusers", "model.args.class_name=UNet2DModel", "model.args.guidance=2"])
    run = tmp_path / "c"
    train(load_config("default", _args(flux, run, "train.steps=1", "data.latent_norm=channel")))
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")]) == 1
    assert "z / scaling_factor + shift_factor: train with data.latent_norm=vae" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _schnell(flux):
    pipe = flux["root"] / "schnell"
    if not pipe.exists():
        save_flux(pipe, guidance_embeds=False, scheduler={"shift": 2.0, "use_dynamic_shifting": False})
    return pipe


def test_flux_forward_flops_on_the_meta_device(flux):
    from fasttrain.models import forward_flops

    text = json.loads((flux["lat"] / "fasttrain-manifest.json").read_text())["text"]
    assert forward_flops("diffusers", in_channels=16, image_size=8, class_name="FluxTransformer2DModel",
                         config={**FLUX, "guidance_embeds": True}, text=text,
                         flow_sigma=schedule("flow", 1000).sigma) > 0
