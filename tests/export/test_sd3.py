"""SD3 (issue 31 part B2): the shifted flow schedule, SD3Transformer2DModel as a backbone on a tiny SD3-shaped
pipeline (CLIP pair + T5, built and saved locally), the pipeline's scheduler adopted, and the
StableDiffusion3Pipeline export reproducing fasttrain's samples."""
import json

import pytest
import torch
from text_fixtures import SD3, save_sd3, write_captioned

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.diffusion import schedule
from fasttrain.diffusion.solvers import spacing
from fasttrain.errors import ConfigError, InvalidInput
from fasttrain.pretrained.scheduler_config import from_diffusers
from fasttrain.train import train

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

TRAIN = ["data.name=captioned_latents", "data.batch_size=4", "train.threads=1", "train.progress=false",
         "model.name=diffusers", "model.args.class_name=SD3Transformer2DModel", "model.args.subfolder=transformer",
         "sample.num=2", "sample.steps=3", "sample.solver=flow_euler", "eval.num_samples=0", "eval.bpd=false",
         "train.log_every=1", "train.ckpt_every=0", "optim.warmup_steps=1", "data.latent_norm=vae",
         "diffusion.weighting=simple", "sample.guidance=2.0", "sample.prompts=[a red square,a blue circle]"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    pipe = save_sd3(root / "pipe")
    images = write_captioned(root / "img")
    lat = root / "lat"
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(lat), "--image-size", "16", "--batch-size", "4"]) == 0
    return {"root": root, "pipe": pipe, "lat": lat}


def _args(sd3, run, *more):
    return [f"run_dir={run}", f"data.root={sd3['lat']}", f"model.args.pretrained={sd3['pipe']}", *TRAIN, *more]


def test_shifted_flow_schedule_is_diffusers_flow_match_grid():
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = schedule("flow", 1000, shift=3.0)
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas.flip(0).double()  # its training sigmas, t ascending
    torch.testing.assert_close(s.sigma, ref, atol=1e-6, rtol=0)  # float32 in diffusers
    torch.testing.assert_close(s.alpha, 1 - s.sigma)
    plain = schedule("flow", 1000)
    assert (s.sigma[:-1] > plain.sigma[:-1]).all() and s.sigma[-1] == 1  # noisier everywhere, same end
    assert (s.snr[:-1] < plain.snr[:-1]).all()  # the SNR table (weightings, samplers) follows
    with pytest.raises(InvalidInput, match="flow schedule only, not 'linear'"):
        schedule("linear", 1000, shift=3.0)


def test_pipeline_scheduler_gives_the_shift_and_a_contradiction_is_one_line(sd3, tmp_path):
    cfg_file = json.loads((sd3["pipe"] / "scheduler" / "scheduler_config.json").read_text())
    assert from_diffusers(cfg_file, "x")["diffusion.flow_shift"] == 3.0
    with pytest.raises(InvalidInput, match="use_dynamic_shifting"):
        from_diffusers({**cfg_file, "use_dynamic_shifting": True}, "x")
    cfg = load_config("default", _args(sd3, tmp_path / "r"))
    assert (cfg.diffusion.schedule, cfg.diffusion.prediction, cfg.diffusion.flow_shift) == ("flow", "flow", 3.0)
    with pytest.raises(ConfigError, match=r"bad value for 'diffusion.flow_shift': 1.0 .*has 3.0"):
        load_config("default", _args(sd3, tmp_path / "r", "diffusion.flow_shift=1.0"))
    with pytest.raises(ConfigError, match=r"'diffusion.schedule': 'linear' \(SD3Transformer2DModel trains on the flow"):
        load_config("default", [f"run_dir={tmp_path / 'r'}", f"data.root={sd3['lat']}", *TRAIN,
                                "model.args.config.num_layers=1"])
    with pytest.raises(ConfigError, match="'diffusion.flow_shift': 2.0 .*flow schedule only"):
        load_config("default", ["diffusion.flow_shift=2.0"])


def test_sd3_trains_resumes_exactly_samples_and_exports(sd3, tmp_path):
    """Prepare (CLIP pair + T5), train 2 steps, resume to 3 = 3 straight (losses and weights bit-equal), sample
    with prompts, export; StableDiffusion3Pipeline loads the folder and makes fasttrain's latents."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("default", _args(sd3, a, "train.steps=4")))
    train(load_config("default", _args(sd3, b, "train.steps=2", "sample.num=0")))
    train(load_config("default", _args(sd3, b, "train.steps=4"), resume=True), resume=True)
    loss = [[r["loss"] for r in map(json.loads, (x / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
            for x in (a, b)]
    assert len(loss[0]) == 4 and loss[0] == loss[1]
    sa, sb = (torch.load(x / "last.pt", weights_only=True)["model"] for x in (a, b))
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    ba = ModelBundle.load(a, device="cpu")
    assert ba.schedule.shift == 3.0 and ba.spec.text["family"] == "sd3"
    assert not any("flow_time" in k for k in sa)  # a buffer rebuilt from the config, not in checkpoints

    prompts, steps, guidance = ["a red square", "a blue circle"], 3, 2.0
    ours = ba.generate(2, seed=0, steps=steps, solver="flow_euler", guidance=guidance, first_image=0,
                       prompts=prompts, negative_prompt="a dog", spacing="trailing")
    assert ours.shape == (2, 4, 8, 8) and not torch.allclose(ours[0], ours[1])
    assert main(["sample", "--ckpt", str(a), "--n", "2", "--steps", "2", "--prompt", "a red square",
                 "--negative-prompt", "a dog", "--guidance", "2", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "00001.png").is_file()  # decoded by the SD3-style VAE (shift_factor)

    out = tmp_path / "export"
    assert main(["export", str(a), "--to", "diffusers", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline" and index["text_encoder_3"][1] == "T5EncoderModel"
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(out)  # stock class, no remote code
    sigmas = [(t + 1) / 1000 for t in spacing("flow_euler", ba.schedule, steps, "trailing")]  # unshifted grid
    got = pipe(prompts, negative_prompt=["a dog"] * 2, num_inference_steps=steps, guidance_scale=guidance,
               sigmas=sigmas, height=16, width=16, output_type="latent",
               generator=[torch.Generator().manual_seed(i) for i in range(2)]).images
    assert (got - ours).abs().max() <= 1e-4


def test_forward_flops_of_an_sd3_transformer(sd3):
    """The trainer counts FLOPs on the meta device (on a GPU): the SD3 network takes the run's σ table there."""
    from fasttrain.models import forward_flops

    text = json.loads((sd3["lat"] / "fasttrain-manifest.json").read_text())["text"]
    flops = forward_flops("diffusers", in_channels=4, image_size=8, class_name="SD3Transformer2DModel",
                          config=dict(SD3), text=text, flow_sigma=schedule("flow", 1000, shift=3.0).sigma)
    assert flops > 0


@pytest.mark.parametrize("over", [
    ["diffusion.sampler=logit_normal", "diffusion.weighting=sd3_sigma_sqrt", "diffusion.noise.offset=0.05"],
    ["diffusion.sampler=adaptive", "diffusion.sampler_args.every=2", "diffusion.noise.immiscible=assignment",
     "diffusion.loss.type=huber", "diffusion.backend=torch"],
])
def test_sd3_composes_with_strategies_and_resumes_exactly(sd3, tmp_path, over):
    """Timestep samplers, weightings and noise/loss options read the shifted tables; a resumed run continues
    bit for bit."""
    train(load_config("default", _args(sd3, tmp_path / "a", "train.steps=4", "sample.num=0", *over)))
    train(load_config("default", _args(sd3, tmp_path / "b", "train.steps=2", "sample.num=0", *over)))
    train(load_config("default", _args(sd3, tmp_path / "b", "train.steps=4", "sample.num=0", *over), resume=True),
          resume=True)
    la, lb = ([r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in "ab")
    assert len(la) == 4 and la == lb and all(v == v for v in la)


def test_sd3_under_per_block_activation_checkpointing_matches_eager(sd3, tmp_path):
    train(load_config("default", _args(sd3, tmp_path / "eager", "train.steps=2", "sample.num=0")))
    train(load_config("default", _args(sd3, tmp_path / "ac", "train.steps=2", "sample.num=0", "parallel.ac=full")))
    la, lb = ([r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in ("eager", "ac"))
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-6)


def test_sd3_export_refuses_latents_the_pipeline_cannot_decode(sd3, tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config("default", _args(sd3, run, "train.steps=1", "sample.num=0", "data.latent_norm=channel")))
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "z / scaling_factor + shift_factor: train with data.latent_norm=vae" in err
    assert not (tmp_path / "out").exists()


def test_sd3_lora_resumes_exactly_and_its_exports_give_fasttrains_samples(sd3, tmp_path):
    """LoRA on the SD3 transformer: the adapter alone trains and is checkpointed, 2 + resume to 4 equals 4
    straight; `export --to lora` applied by the stock StableDiffusion3Pipeline's load_lora_weights on the base
    pipeline, and `--to diffusers` (the adapter merged), both make fasttrain's latents."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    lora = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "sample.num=0"]
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config("default", _args(sd3, a, "train.steps=4", *lora)))
    train(load_config("default", _args(sd3, b, "train.steps=2", *lora)))
    train(load_config("default", _args(sd3, b, "train.steps=4", *lora), resume=True), resume=True)
    loss = [[r["loss"] for r in map(json.loads, (x / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
            for x in (a, b)]
    assert len(loss[0]) == 4 and loss[0] == loss[1]
    sa, sb = (torch.load(x / "last.pt", weights_only=True) for x in (a, b))
    assert sa["model"] and all("lora_" in k for k in sa["model"]) and sa["lora"]["sha256"]  # no base weights
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=0, atol=0)
    assert any(sa["model"][k].abs().sum() > 0 for k in sa["model"] if "lora_B" in k)  # B starts at zero

    ba = ModelBundle.load(a, device="cpu")
    prompts, steps, guidance = ["a red square", "a blue circle"], 3, 2.0
    ours = ba.generate(2, seed=0, steps=steps, solver="flow_euler", guidance=guidance, first_image=0,
                       prompts=prompts, negative_prompt="a dog", spacing="trailing")
    sigmas = [(t + 1) / 1000 for t in spacing("flow_euler", ba.schedule, steps, "trailing")]

    def sample(pipe):
        return pipe(prompts, negative_prompt=["a dog"] * 2, num_inference_steps=steps, guidance_scale=guidance,
                    sigmas=sigmas, height=16, width=16, output_type="latent",
                    generator=[torch.Generator().manual_seed(i) for i in range(2)]).images

    full, out = tmp_path / "full", tmp_path / "lora"
    assert main(["export", str(a), "--to", "diffusers", str(full)]) == 0  # the adapter merged
    merged = StableDiffusion3Pipeline.from_pretrained(full)
    assert not any("lora" in k for k in merged.transformer.state_dict())
    assert (sample(merged) - ours).abs().max() <= 1e-4
    assert main(["export", str(a), "--to", "lora", str(out)]) == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    # the base pipeline: the full export with the pretrained transformer, then the adapter loaded
    base = StableDiffusion3Pipeline.from_pretrained(
        full, transformer=SD3Transformer2DModel.from_pretrained(sd3["pipe"], subfolder="transformer"))
    plain = sample(base)
    base.load_lora_weights(str(out))
    assert base.get_active_adapters()
    assert (sample(base) - ours).abs().max() <= 1e-4
    assert (plain - ours).abs().max() > 1e-3  # without the adapter: other samples
